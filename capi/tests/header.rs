//! `include/cudalloc.h` against the built `libcudalloc_capi.so`: a C program (and the header as C++)
//! compiled with the system's `cc`/`c++` and run, once normally and once with the abort action
//! (which must close a running trace before aborting). Skipped, with a note, where there is no
//! compiler or the shared library is not next to this test binary (`cargo test` builds it into
//! the same `deps` folder).

use cudalloc_capi::memory_snapshot;
use std::path::{Path, PathBuf};
use std::process::Command;

const PROGRAM: &str = r#"
#include "cudalloc.h"
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    char small[4] = {'x', 'x', 'x', 'x'};
    if (argc > 1) {
        printf("trace %d\n", cudalloc_trace_start(argv[1]));
        printf("previous %d\n", cudalloc_set_malloc_failure_action(CUDALLOC_MALLOC_ABORT));
        fflush(stdout);
        cudalloc_malloc((size_t)1 << 50, 0, NULL);
        printf("survived\n");
        return 0;
    }
    void *p = cudalloc_malloc(1024, 0, NULL);
    int gpu = p != NULL;
    printf("gpu %d\n", gpu);
    if (!gpu) {
        printf("error %s\n", cudalloc_last_error());
    }
    size_t need = cudalloc_stats_json(0, small, sizeof small);
    printf("need %zu untouched %d\n", need, small[0] == 'x' && small[3] == 'x');
    if (gpu) {
        char big[65536];
        size_t got = cudalloc_stats_json(0, big, sizeof big);
        printf("got %zu nul %d\n", got, got < sizeof big && big[got] == '\0');
        printf("has_key %d\n", strstr(big, "\"allocated_bytes.all.peak\"") != NULL);
        cudalloc_free(p, 1024, 0, NULL);
    }
    cudalloc_free(NULL, 0, 0, NULL);
    printf("layout %zu %zu %zu\n", sizeof(cudalloc_snapshot_header), sizeof(cudalloc_segment),
           sizeof(cudalloc_block));
    printf("snapshot %zu\n", cudalloc_memory_snapshot(0, 0, 0, NULL, 0));
    int pushed = cudalloc_tag_push("weights");
    printf("tag_push %d depth %d\n", pushed, cudalloc_tag_depth());
    printf("tag_bad %d\n", cudalloc_tag_push("a,b"));
    int popped = cudalloc_tag_pop();
    printf("tag_pop %d %d\n", popped, cudalloc_tag_pop());
    printf("sleep_null %d %d\n", cudalloc_sleep(0, NULL, NULL), cudalloc_last_error_kind());
    printf("kind_incomplete %d\n", CUDALLOC_ERROR_SLEEP_INCOMPLETE);
    printf("linked %d %d %zu\n", cudalloc_wake(0, "", NULL), cudalloc_release_host_buffers(0),
           cudalloc_tag_stats_json(0, NULL, 0));
    int bad = cudalloc_trace_start("/nonexistent-cudalloc-dir/t.csv");
    printf("trace_start %d %s\n", bad, cudalloc_last_error());
    printf("trace_stop %d\n", cudalloc_trace_stop());
    printf("history_layout %zu %zu\n", sizeof(cudalloc_history_header), sizeof(cudalloc_event));
    int started = cudalloc_history_start(100, 1);
    int on = cudalloc_history_enabled();
    int clash = cudalloc_trace_start("/nonexistent-cudalloc-dir/clash.csv");
    size_t bytes = cudalloc_memory_history(NULL, 0);
    int stopped = cudalloc_history_stop();
    printf("history %d %d %d %zu %d %d\n", started, on, clash, bytes, stopped,
           cudalloc_history_enabled());
    cudalloc_shared_t shared;
    int fds[4];
    unsigned long long sizes[4];
    printf("share %lld\n", cudalloc_share(NULL, 0, &shared, fds, sizes, 4));
    printf("open %d\n", cudalloc_open_shared(0, &shared, fds, sizes, 0) != NULL);
    printf("close %d\n", cudalloc_close_shared(NULL, 0));
    printf("hooks %d\n", cudalloc_set_map_hooks(0, NULL, NULL, NULL));
    printf("shared_layout %zu\n", sizeof(cudalloc_shared_t));
    return 0;
}
"#;

fn tool(name: &str) -> bool {
    Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn library_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.to_path_buf();
    dir.join("libcudalloc_capi.so").exists().then_some(dir)
}

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

#[test]
fn the_header_compiles_as_c_and_cxx_and_links() {
    // Nothing here is skipped silently: a missing compiler, header or library fails the test.
    assert!(tool("cc"), "this test needs a C compiler (cc)");
    assert!(
        include_dir().join("cudalloc.h").exists(),
        "{} is missing (run the test from the repository)",
        include_dir().display()
    );
    let lib = library_dir().expect("libcudalloc_capi.so is not next to the test binary");
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("smoke.c");
    std::fs::write(&src, PROGRAM).unwrap();
    let exe = dir.join("smoke");
    let rpath = format!("-Wl,-rpath,{}", lib.display());
    let out = Command::new("cc")
        .args(["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-I"])
        .arg(include_dir())
        .arg(&src)
        .arg("-L")
        .arg(&lib)
        .args(["-lcudalloc_capi", &rpath, "-o"])
        .arg(&exe)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let run = Command::new(&exe)
        .env_remove("CUDALLOC_CONF")
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let text = String::from_utf8(run.stdout).unwrap();
    eprintln!("{text}");
    let line = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key).map(str::trim).map(str::to_string))
            .unwrap_or_else(|| panic!("no `{key}` in\n{text}"))
    };
    if line("gpu ") == "0" {
        assert!(line("error ").contains("no CUDA device"), "{text}");
        assert_eq!(
            line("need "),
            "0 untouched 1",
            "failure: 0 and nothing written"
        );
    } else {
        let need: Vec<&str> = text
            .lines()
            .find(|l| l.starts_with("need "))
            .unwrap()
            .split(' ')
            .collect();
        assert!(need[1].parse::<usize>().unwrap() > 4, "{text}");
        assert_eq!(need[3], "1", "a too-small buffer is left alone");
        assert!(line("got ").ends_with("nul 1"), "{text}");
        assert_eq!(line("has_key "), "1");
    }
    // Sharing a NULL pointer, opening nothing and closing what was never opened fail; removing
    // hooks needs a device.
    assert_eq!(line("share "), "-1", "{text}");
    assert_eq!(
        (line("open "), line("close ")),
        ("0".into(), "-1".into()),
        "{text}"
    );
    let gpu = line("gpu ") == "1";
    assert_eq!(line("hooks "), if gpu { "0" } else { "-1" }, "{text}");
    let shared_layout = std::mem::size_of::<cudalloc_capi::CShared>().to_string();
    assert_eq!(
        line("shared_layout "),
        shared_layout,
        "cudalloc_shared_t matches CShared"
    );
    let layout = format!(
        "{} {} {}",
        memory_snapshot::HEADER_BYTES,
        memory_snapshot::SEGMENT_BYTES,
        memory_snapshot::BLOCK_BYTES
    );
    assert_eq!(
        line("layout "),
        layout,
        "the structs' sizes are the Rust writer's"
    );
    let snapshot = line("snapshot ").parse::<usize>().unwrap();
    if line("gpu ") == "0" {
        assert_eq!(snapshot, 0, "no device: a failure");
    } else {
        assert!(snapshot >= memory_snapshot::HEADER_BYTES, "{text}");
    }
    assert_eq!(line("tag_push "), "0 depth 1");
    assert_eq!(line("tag_bad "), "-1");
    assert_eq!(line("tag_pop "), "0 -1");
    assert_eq!(
        line("sleep_null "),
        "-1 1",
        "NULL tags: a failure of kind other"
    );
    assert_eq!(line("kind_incomplete "), "3");
    assert!(line("trace_start ").starts_with("-1 cudalloc_trace_start: cannot write"));
    assert_eq!(line("trace_stop "), "-1");
    assert_eq!(
        line("history_layout "),
        "8 40",
        "cudalloc_event is 40 bytes"
    );
    // Started, kept, a trace refused meanwhile, no event yet (the header alone), stopped.
    assert_eq!(line("history "), "0 1 -1 8 0 0", "{text}");

    // With the abort action a failed malloc prints its reason and aborts.
    let trace = dir.join("aborted.trace.csv.gz");
    let aborted = Command::new(&exe).arg(&trace).output().unwrap();
    let out = String::from_utf8_lossy(&aborted.stdout);
    let err = String::from_utf8_lossy(&aborted.stderr);
    assert!(!aborted.status.success(), "{out}");
    assert!(
        out.contains("previous 0") && !out.contains("survived"),
        "{out}"
    );
    assert!(err.contains("cudalloc: cudalloc_malloc"), "{err}");
    assert!(err.contains("aborting"), "{err}");
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(aborted.status.signal(), Some(6), "SIGABRT");
    }
    // The trace was closed before the abort: a complete gzip file that reads back, ending (on
    // a GPU) with the failed request's `oom`; without one the malloc failed before any
    // allocator existed and the trace is empty.
    let t = cudalloc_trace::read(&trace).unwrap();
    assert_eq!(t.anomalies, Default::default());
    let gpu = line("gpu ") == "1";
    assert_eq!(t.events, u64::from(gpu), "the trace's events: {t:?}");

    if tool("c++") {
        let out = Command::new("c++")
            .args([
                "-std=c++17",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-fsyntax-only",
                "-x",
                "c++",
                "-I",
            ])
            .arg(include_dir())
            .arg(&src)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every function the library exports and every `CUDALLOC_` constant of `lib.rs` is declared in
/// the header, and the header declares no function the library lacks.
#[test]
fn the_header_declares_exactly_the_exported_functions_and_constants() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let header = std::fs::read_to_string(include_dir().join("cudalloc.h")).unwrap();
    let names_after = |text: &str, marker: &str| -> Vec<String> {
        text.match_indices(marker)
            .map(|(i, _)| {
                text[i + marker.len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect()
            })
            .collect()
    };
    let exported = names_after(&lib, "pub extern \"C\" fn ");
    assert!(exported.len() > 20, "{exported:?}");
    for f in &exported {
        let declared = header.contains(&format!(" {f}(")) || header.contains(&format!("*{f}("));
        assert!(declared, "{f} is not declared in cudalloc.h");
    }
    for k in names_after(&lib, "pub const ")
        .iter()
        .filter(|k| k.starts_with("CUDALLOC_"))
    {
        assert!(
            header.contains(&format!("#define {k} ")),
            "{k} is not defined in cudalloc.h"
        );
    }
    let mut names = names_after(&header, " cudalloc_");
    names.extend(names_after(&header, "*cudalloc_"));
    let declared: Vec<String> = names
        .into_iter()
        .filter(|n| {
            header.contains(&format!(" cudalloc_{n}("))
                || header.contains(&format!("*cudalloc_{n}("))
        })
        .map(|n| format!("cudalloc_{n}"))
        .filter(|n| !n.ends_with("_t"))
        .collect();
    for f in declared {
        assert!(
            exported.contains(&f),
            "cudalloc.h declares {f}, which the library lacks"
        );
    }
}
