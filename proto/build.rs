// Compiles proto/ with protox (a pure-Rust protobuf compiler), so building needs no
// system protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/disagg/v1/inference.proto", "proto/disagg/v1/worker.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure().codec_path("crate::codec::ProtoCodec").compile_fds(fds)?;
    Ok(())
}
