//! The `cudalloc` command line, run as a built binary, on what a user review found: `key=value` in
//! a config string named as such (it says to write `key:value`).

use cudalloc::Config;
use std::path::Path;
use std::process::Command;

/// What one run of the binary did.
struct Ran {
    code: Option<i32>,
    out: String,
    err: String,
}

fn run(args: &[&str]) -> Ran {
    let o = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the cudalloc binary runs");
    Ran {
        code: o.status.code(),
        out: String::from_utf8_lossy(&o.stdout).into_owned(),
        err: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

fn bert() -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces");
    dir.join("bert_dynamic.trace.csv.gz")
        .to_string_lossy()
        .into_owned()
}

/// `--config key=value` (the `--sweep` spelling) is an error naming the key and the
/// `key:value` to write, in the library's parser and on the command line.
#[test]
fn a_config_entry_written_with_equals_says_to_use_a_colon() {
    for (s, key, write) in [
        ("max_chunk_mb=16", "max_chunk_mb", "`max_chunk_mb:16`"),
        (
            "policy:torch,max_split_size_mb=128",
            "max_split_size_mb",
            "`max_split_size_mb:128`",
        ),
        ("max_chunk_mb = 16", "max_chunk_mb", "`max_chunk_mb:value`"),
    ] {
        let e = Config::parse(s).unwrap_err();
        assert_eq!(e.key, key, "{s}");
        assert!(e.message.contains(write), "{s}: {e}");
    }
    let r = run(&["replay", "--config", "max_chunk_mb=16", &bert()]);
    assert_eq!(r.code, Some(2), "{}", r.out);
    assert!(
        r.err.contains("max_chunk_mb:16") && r.err.contains("colon"),
        "{}",
        r.err
    );
}
