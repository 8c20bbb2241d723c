//! Compiles every `.proto` under `proto/` with Debian's `protoc` (found on PATH or via PROTOC).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir("proto")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "proto"))
        .collect();
    files.sort();
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&files, &[PathBuf::from("proto")])?;
    Ok(())
}
