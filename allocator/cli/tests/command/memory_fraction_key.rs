//! The command line counts the `per_process_memory_fraction` config key as a cap.

/// The command line takes the key as a cap: `garbage_collection_threshold` (which needs one)
/// is accepted with it, where without any cap it is refused.
#[test]
fn the_command_line_counts_the_key_as_a_cap() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../traces/bert_dynamic.trace.csv.gz"
    );
    let run = |conf: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_cudalloc"))
            .args(["replay", "--json", "--config", conf, trace])
            .output()
            .expect("cudalloc runs")
    };
    let o = run("policy:torch,garbage_collection_threshold:0.8,per_process_memory_fraction:0.01");
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = run("policy:torch,garbage_collection_threshold:0.8");
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("per_process_memory_fraction"), "{err}");
}
