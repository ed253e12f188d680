//! The disagg protobuf/gRPC definitions (`proto/`), generated at build time.
//!
//! Declarative only: types, service stubs, nothing else. Engine types do not derive
//! prost; servers convert at their edge.

pub mod v1 {
    tonic::include_proto!("disagg.v1");
}
