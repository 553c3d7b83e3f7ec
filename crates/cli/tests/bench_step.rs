//! `switchyard bench step` on the real default model, where its cell cannot be measured.

use std::process::Command;

/// 16 sequences of up to 286 positions need about 105 MB of f16 K/V; a 200 MiB budget leaves
/// 32 MB after the weights and the workspace. The cell says so as soon as the requests end
/// (the message of the cell's half-hour timeout is another).
#[test]
fn a_cell_the_budget_cannot_hold_fails_at_once_and_says_why() {
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "bench",
            "step",
            "--model",
            "smollm2-135m-instruct",
            "--threads",
            "2",
        ])
        .args(["--batches", "16", "--contexts", "256", "--steps", "2"])
        .args(["--memory-budget", "200MiB"])
        .output()
        .expect("run bench step");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "batch 16, context 256: 0 full decode steps before the requests ended; 16 sequences \
             of up to 286 positions do not fit the memory budget together (raise --memory-budget)"
        ),
        "{stderr}"
    );
}
