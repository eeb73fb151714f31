//! The workspace-size parsers (pure; no GPU): `CUBLAS_WORKSPACE_CONFIG` entries sum to
//! `SIZE * COUNT` KiB whether written one after another or separated, PyTorch's defaults apply
//! when the variable is unset or blank, and every malformed entry is an error that names the
//! variable and the entry. Same for `CUBLASLT_WORKSPACE_SIZE`.

use cudalloc::workspace::{
    lt_workspace_bytes, workspace_bytes, WorkspaceConfig, WorkspaceEntry, LT_WORKSPACE_ENV,
    WORKSPACE_ENV,
};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

#[test]
fn single_and_concatenated_entries() {
    assert_eq!(workspace_bytes(Some(":4096:8"), 8).unwrap(), 32 * MIB);
    assert_eq!(workspace_bytes(Some(":16:8"), 9).unwrap(), 128 * KIB);
    assert_eq!(
        workspace_bytes(Some(":4096:2:16:8"), 9).unwrap(),
        8 * MIB + 128 * KIB
    );
    let cfg = WorkspaceConfig::parse(":4096:2:16:8").unwrap();
    assert_eq!(
        cfg.entries,
        vec![
            WorkspaceEntry {
                size_kib: 4096,
                count: 2
            },
            WorkspaceEntry {
                size_kib: 16,
                count: 8
            }
        ]
    );
}

#[test]
fn separators_and_whitespace_are_allowed() {
    let want = 8 * MIB + 128 * KIB;
    for s in [
        ":4096:2,:16:8",
        ":4096:2 :16:8",
        "  :4096:2, :16:8  ",
        ":4096:2,,:16:8",
    ] {
        assert_eq!(workspace_bytes(Some(s), 9).unwrap(), want, "{s:?}");
    }
}

#[test]
fn zero_is_a_valid_size() {
    assert_eq!(workspace_bytes(Some(":0:0"), 9).unwrap(), 0);
    assert_eq!(workspace_bytes(Some(":4096:0"), 9).unwrap(), 0);
}

#[test]
fn defaults_follow_pytorch() {
    // 32 MiB on compute capability 9.x (H100, H200), :4096:2:16:8 otherwise.
    assert_eq!(workspace_bytes(None, 9).unwrap(), 32 * MIB);
    assert_eq!(
        workspace_bytes(None, 8).unwrap(),
        4096 * KIB * 2 + 16 * KIB * 8
    );
    assert_eq!(workspace_bytes(None, 7).unwrap(), 8 * MIB + 128 * KIB);
    assert_eq!(workspace_bytes(Some(""), 9).unwrap(), 32 * MIB);
    assert_eq!(
        workspace_bytes(Some("   "), 8).unwrap(),
        8 * MIB + 128 * KIB
    );
    assert_eq!(WorkspaceConfig::pytorch_default(9).bytes(), 32 * MIB);
}

/// Parses `s` expecting an error, checks it names the variable and `entry`, returns the reason.
fn error_for(s: &str, entry: &str) -> String {
    let e = workspace_bytes(Some(s), 9).expect_err(s);
    assert_eq!(e.var, WORKSPACE_ENV);
    assert_eq!(e.entry, entry, "wrong entry named for {s:?}: {e}");
    let shown = e.to_string();
    assert!(
        shown.contains(WORKSPACE_ENV) && shown.contains(entry),
        "{shown}"
    );
    e.reason
}

#[test]
fn bad_entries_are_named() {
    assert!(error_for("4096:8", "4096:8").contains("starts with"));
    assert!(error_for(":4096", ":4096").contains("COUNT is missing"));
    assert!(error_for(":4096:x", ":4096:x").contains("COUNT `x`"));
    assert!(error_for(":abc:2", ":abc:2").contains("SIZE `abc`"));
    assert!(error_for(":-1:2", ":-1:2").contains("SIZE `-1`"));
    assert!(error_for(":+4:2", ":+4:2").contains("not a whole number"));
    assert!(error_for(":4096:2:16", ":16").contains("COUNT is missing"));
    assert!(error_for(":4096:8:", ":").contains("SIZE is missing"));
    assert!(error_for("::8", "::8").contains("SIZE is missing"));
    assert!(error_for(":16:8,4096:2", "4096:2").contains("starts with"));
    // The good entry before a bad one does not hide it.
    assert!(error_for(":16:8:4.5:2", ":4.5:2").contains("SIZE `4.5`"));
}

#[test]
fn overflows_are_errors() {
    let huge = format!(":{}:1", u64::MAX);
    assert!(error_for(&huge, &huge).contains("overflows"));
    let big = format!(":{}:2", u64::MAX / 1024);
    assert!(error_for(&big, &big).contains("overflows"));
    assert!(
        error_for(":99999999999999999999999:1", ":99999999999999999999999:1").contains("too large")
    );
    // Each entry fits, the sum does not.
    let half = u64::MAX / 1024 / 2 + 1;
    let s = format!(":{half}:1:{half}:1");
    let e = workspace_bytes(Some(&s), 9).unwrap_err();
    assert!(e.reason.contains("total"), "{e}");
}

#[test]
fn lt_workspace_size_in_kib() {
    assert_eq!(lt_workspace_bytes(None).unwrap(), MIB);
    assert_eq!(lt_workspace_bytes(Some("")).unwrap(), MIB);
    assert_eq!(lt_workspace_bytes(Some("4096")).unwrap(), 4 * MIB);
    assert_eq!(lt_workspace_bytes(Some(" 32768 ")).unwrap(), 32 * MIB);
    assert_eq!(lt_workspace_bytes(Some("0")).unwrap(), 0);
    for bad in ["4MiB", "-1", "1.5", "0x10"] {
        let e = lt_workspace_bytes(Some(bad)).unwrap_err();
        assert_eq!(e.var, LT_WORKSPACE_ENV);
        assert_eq!(e.entry, bad);
    }
    let e = lt_workspace_bytes(Some(&u64::MAX.to_string())).unwrap_err();
    assert!(e.reason.contains("overflows"), "{e}");
}
