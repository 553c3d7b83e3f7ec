//! The process's memory allocator: settings for a model's working set, and handing freed
//! memory back to the system.
//!
//! glibc's malloc serves a request of at least its mmap threshold (128 KiB at start, raised
//! as such blocks are freed) with a fresh mapping, and returns free memory at the top of its
//! heap to the system past its trim threshold. A prompt pass allocates and frees activations
//! of megabytes in every layer (a 512-row pass through Qwen2.5-Coder-1.5B's MLP: 18 MB per
//! buffer), so each layer's buffers were faulted in and zeroed page by page again: about a
//! tenth of the pass. [`tune_for_inference`] fixes both thresholds so that such buffers are
//! reused from the heap; weights freed when an engine drops layers are then returned by
//! [`return_free_memory`] rather than by the allocator's own trimming.

/// Blocks of this size and above get their own mapping (glibc's largest allowed threshold).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 32 << 20;
/// Free memory at the top of the heap beyond this goes back to the system at once.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: libc::c_int = 64 << 20;

/// Fixes the allocator's thresholds for serving (see the module notes). Call once, early,
/// before models load. Returns whether the settings took (false on other allocators).
pub fn tune_for_inference() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes glibc's parameters; any value is accepted or refused.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// Hands the allocator's whole free pages back to the system (those inside the heap too,
/// which trimming never reaches): call after freeing a model's layers, so that resident
/// memory follows what is loaded.
pub fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident memory of this process, from /proc (Linux).
    fn resident_bytes() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// Under the tuned thresholds, 200 MiB of 4 MiB blocks (a model's layers) freed in the
    /// middle of the heap stay resident until `return_free_memory`, which hands them back.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_layers_go_back_to_the_system() {
        assert!(tune_for_inference());
        let touched = |n: usize| -> Vec<Vec<u8>> { (0..n).map(|_| vec![1u8; 4 << 20]).collect() };
        let layers = touched(50);
        // Kept above the layers, so that their memory is not at the heap's top.
        let keep = touched(1);
        let before = resident_bytes().expect("VmRSS");
        drop(layers);
        return_free_memory();
        let after = resident_bytes().expect("VmRSS");
        assert!(
            before.saturating_sub(after) >= 150 << 20,
            "resident {before} -> {after} bytes after freeing 200 MiB"
        );
        drop(keep);
    }
}
