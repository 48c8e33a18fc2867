//! Precision as the field judges quantized inference: `gateway eval-kl` against llama.cpp's
//! `llama-perplexity --kl-divergence` on the same GGUF, the same tokens (Debian's FAQ, fetched
//! with `apt-get download`) and the same full-precision reference (llama.cpp's own, from the GGUF
//! written out as F32 by `llama-quantize`). Our f32 path must agree with llama.cpp's, and every
//! kernel setting we ship must be no further from it than llama.cpp's kernels are.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Chunks of 512 tokens scored (the second half of each): 2,040 tokens per model.
const CHUNKS: &str = "8";

/// The folder of the llama.cpp peer's binaries (beside `llama-server`), if this run has one.
fn peer() -> Option<PathBuf> {
    let Some(server) = std::env::var_os("GATEWAY_LLAMA_SERVER") else {
        assert!(
            std::env::var("GATEWAY_TEST_SERVICES").as_deref() != Ok("required"),
            "GATEWAY_LLAMA_SERVER must name the peer's llama-server (host/scripts/test.sh)"
        );
        println!("SKIPPED: GATEWAY_LLAMA_SERVER is not set (host/scripts/test.sh builds the peer)");
        return None;
    };
    Some(Path::new(&server).parent().unwrap().to_path_buf())
}

/// Debian's FAQ as plain text, downloaded once into the test's temporary folder. The tests of
/// this file run in parallel: one lock lets a single test fetch it, and the package is unpacked
/// in a folder of this process's own before the text is renamed into place, so a concurrent
/// run never sees (or unpacks over) a half-written tree.
fn faq_text() -> PathBuf {
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _once = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kl-faq");
    let text = dir.join("debian-faq.en.txt");
    if text.exists() {
        return text;
    }
    let work = dir.join(format!("fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let run = |cmd: &mut Command| assert!(cmd.status().unwrap().success(), "{cmd:?} failed");
    run(Command::new("apt-get")
        .args(["download", "debian-faq"])
        .current_dir(&work));
    let deb = std::fs::read_dir(&work)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .expect("debian-faq .deb");
    run(Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(work.join("pkg")));
    let gz = work.join("pkg/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz");
    let out = Command::new("gunzip").arg("-c").arg(gz).output().unwrap();
    assert!(out.status.success());
    let part = work.join("debian-faq.en.txt");
    std::fs::write(&part, out.stdout).unwrap();
    std::fs::rename(&part, &text).unwrap();
    let _ = std::fs::remove_dir_all(&work);
    text
}

/// Runs llama.cpp's tool, without its repacked weight buffers when they crash (ggml's AMX
/// buffers segfault on some CPUs with AMX); returns its output (its log goes to stderr, its
/// summary to stdout).
fn llama(bin: &Path, args: &[&str]) -> String {
    for extra in [&[][..], &["--no-repack"][..]] {
        let out = Command::new(bin).args(args).args(extra).output().unwrap();
        if out.status.success() {
            let (o, e) = (&out.stdout, &out.stderr);
            return String::from_utf8_lossy(o).into_owned() + &String::from_utf8_lossy(e);
        }
        eprintln!(
            "{} {args:?} {extra:?} failed: {}",
            bin.display(),
            out.status
        );
    }
    panic!("{} failed with and without repacking", bin.display());
}

/// A figure from llama-perplexity's summary (`Mean    KLD:   0.002816 ± …`).
fn figure(log: &str, label: &str) -> f64 {
    let line = log
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} in llama-perplexity's output:\n{log}"));
    let value = line.split(':').nth(1).unwrap().split_whitespace().next();
    value.unwrap().trim_end_matches('%').parse().unwrap()
}

/// Bytes free in the file system holding `dir` (`df`, as the tests carry no libc binding).
fn free_bytes(dir: &Path) -> u64 {
    let out = Command::new("df")
        .args(["-B1", "--output=avail"])
        .arg(dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or(0)
}

/// The F32 GGUF and llama.cpp's reference are large (Gemma 3's: 1.07 GB each, 2,040 full
/// distributions over 262,144 tokens) and live only for one check. They go to RAM-backed
/// `/dev/shm` when it has room: CI's disk has been seen nearly full, and a reference cut short
/// by a full disk is what once failed this test.
fn scratch(file: &str) -> PathBuf {
    let shm = Path::new("/dev/shm");
    let dir = if free_bytes(shm) > 4 << 30 {
        shm.join(format!("gateway-kl-{}", std::process::id()))
    } else {
        Path::new(env!("CARGO_TARGET_TMPDIR")).join("kl")
    };
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(file)
}

/// Removes a check's files however it ends (a panic included), so RAM is not left holding them.
struct Remove(Vec<PathBuf>);

impl Drop for Remove {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
        if let Some(dir) = self.0.first().and_then(|p| p.parent()) {
            let _ = std::fs::remove_dir(dir); // only once empty: the other model's check may follow
        }
    }
}

fn check(file: &str) {
    let Some(peer) = peer() else { return };
    // One model at a time: the peak of files is one model's, and two llama.cpp runs of two
    // threads each on two cores would only take turns.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let model = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
    assert!(Path::new(&model).exists(), "{model} is missing");
    let text = faq_text();
    let at = scratch(file);
    let (f32, base) = (at.with_extension("f32.gguf"), at.with_extension("base"));
    let _remove = Remove(vec![f32.clone(), base.clone()]);
    let (f32s, bases) = (f32.to_str().unwrap(), base.to_str().unwrap());
    llama(
        &peer.join("llama-quantize"),
        &["--allow-requantize", &model, f32s, "F32"],
    );
    let threads = std::thread::available_parallelism().unwrap().to_string();
    let common = ["-c", "512", "-t", &threads, "--kl-divergence-base", bases];
    let f = ["-m", f32s, "-f", text.to_str().unwrap(), "--chunks", CHUNKS];
    llama(&peer.join("llama-perplexity"), &[&f[..], &common].concat());
    std::fs::remove_file(&f32).unwrap();
    let log = llama(
        &peer.join("llama-perplexity"),
        &[&["-m", &model, "--kl-divergence"][..], &common].concat(),
    );
    assert!(
        !log.contains("failed reading"),
        "llama.cpp's reference {} is cut short (a full disk?):\n{log}",
        base.display()
    );
    let (llama_kl, llama_top) = (
        figure(&log, "Mean    KLD"),
        figure(&log, "Same top p") / 100.0,
    );

    let out = Command::new(env!("CARGO_BIN_EXE_gateway"))
        .args(["eval-kl", "-m", &model, "--llama-base", bases, "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("{file}: llama.cpp mean KLD {llama_kl:.3e}, same top {llama_top:.4}");
    println!("{}", serde_json::to_string_pretty(&r).unwrap());
    assert_eq!(r["chunks"], 8);
    let num = |v: &Value, k: &str| v[k].as_f64().unwrap();
    // Our f32 path and llama.cpp's compute the same distributions (to their f16 KV caches and
    // summation orders): a gap here would make every comparison below meaningless.
    let agree = &r["f32_vs_llama_f32"];
    assert_eq!(agree["tokens"], 8 * 255);
    assert!(num(agree, "kl_mean") < 1e-4, "f32 paths disagree: {agree}");
    assert!(
        num(agree, "top1_agreement") >= 0.99,
        "f32 paths disagree: {agree}"
    );
    // Top-1 agreement over 2,040 tokens moves by a few tokens with any change of rounding: the
    // 8-bit settings (llama.cpp's own rounding) are held to within two standard errors of
    // llama.cpp's, the others (16-bit, and BF16 prompt rows) strictly.
    let n = num(agree, "tokens");
    let noise = 2.0 * (llama_top * (1.0 - llama_top) / n).sqrt();
    for s in r["settings"].as_array().unwrap() {
        let (name, ours) = (&s["setting"], &s["vs_llama_f32"]);
        assert!(
            num(ours, "kl_mean") <= llama_kl,
            "{file} {name}: mean KLD {} above llama.cpp's {llama_kl}",
            ours["kl_mean"]
        );
        let eight = name == "decode8" || name == "prompt8";
        let slack = if eight { noise } else { 0.0 };
        assert!(
            num(ours, "top1_agreement") >= llama_top - slack,
            "{file} {name}: top-1 agreement {} below llama.cpp's {llama_top}",
            ours["top1_agreement"]
        );
        assert!(num(&s["vs_f32"], "kl_mean") < llama_kl);
    }
}

/// The embedded default: Q4_1 layers, a Q8_0 embedding table.
#[test]
fn smollm2_kernels_are_no_further_from_f32_than_llama_cpp() {
    check("SmolLM2-135M-Instruct.Q4_1.gguf");
}

/// Q4_K and Q6_K beside Q5_0 and Q8_0: every setting of the k-quant kernels, 8-bit included.
#[test]
fn gemma3_kernels_are_no_further_from_f32_than_llama_cpp() {
    check("gemma-3-270m.Q4_K_M.gguf");
}
