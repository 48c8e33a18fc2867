//! With the `cuda` feature, compiles each `src/*.cu` with nvcc into a fatbin holding SASS for
//! sm_80 (A100) and sm_90 (H100/H200) plus sm_90 PTX for newer GPUs, embedded in the crate.
//! Without the feature there is nothing to build.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    const SOURCES: [&str; 2] = ["attention", "layers"];
    for src in SOURCES {
        println!("cargo:rerun-if-changed=src/{src}.cu");
    }
    println!("cargo:rerun-if-changed=src/common.cuh");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin/nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for src in SOURCES {
        let fatbin = out.join(format!("{src}.fatbin"));
        let status = Command::new(&nvcc)
            .args([
                "-fatbin",
                "-O3",
                "-std=c++17",
                "--use_fast_math",
                "-Xptxas=-warn-spills",
                "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_90,code=sm_90",
                "-gencode=arch=compute_90,code=compute_90",
            ])
            .arg(format!("src/{src}.cu"))
            .arg("-o")
            .arg(&fatbin)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "running {}: {e}. The `cuda` feature needs nvcc: set CUDA_HOME (kernels/install-nvcc.sh installs one from PyPI).",
                    nvcc.display()
                )
            });
        assert!(status.success(), "nvcc failed to compile src/{src}.cu");
    }
}
