//! The disagg protobuf/gRPC definitions (`proto/`), generated at build time.
//!
//! Declarative only: types, service stubs, nothing else. Engine types do not derive
//! prost; servers convert at their edge.

pub mod v1 {
    tonic::include_proto!("disagg.v1");
}

/// The codec of every generated service: prost's, except that a message that does not
/// decode is answered with INVALID_ARGUMENT (the client sent bytes that are not the
/// message) instead of tonic's INTERNAL, so callers can tell their mistake from ours.
pub mod codec {
    use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
    use tonic::Status;
    use tonic_prost::{ProstCodec, ProstDecoder};

    pub struct ProtoCodec<T, U>(ProstCodec<T, U>);

    impl<T, U> Default for ProtoCodec<T, U> {
        fn default() -> Self {
            ProtoCodec(ProstCodec::default())
        }
    }

    impl<T, U> Codec for ProtoCodec<T, U>
    where
        T: prost::Message + Send + 'static,
        U: prost::Message + Default + Send + 'static,
    {
        type Encode = T;
        type Decode = U;
        type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
        type Decoder = InvalidArgumentOnError<U>;

        fn encoder(&mut self) -> Self::Encoder {
            self.0.encoder()
        }

        fn decoder(&mut self) -> Self::Decoder {
            InvalidArgumentOnError(self.0.decoder())
        }
    }

    pub struct InvalidArgumentOnError<U>(ProstDecoder<U>);

    impl<U: prost::Message + Default> Decoder for InvalidArgumentOnError<U> {
        type Item = U;
        type Error = Status;

        fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
            self.0.decode(buf).map_err(|e| Status::invalid_argument(format!("malformed message: {}", e.message())))
        }

        fn buffer_settings(&self) -> BufferSettings {
            self.0.buffer_settings()
        }
    }
}
