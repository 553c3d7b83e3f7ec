//! KV block memory carved from large anonymous mappings that ask for transparent huge pages.
//!
//! A batched decode step reads every running sequence's K/V once: at 187 sequences of 400
//! positions on SmolLM2 that is 1.7 GB per step, spread over 140,000 blocks of 12 KiB, whose
//! page tables on 4 KiB pages (3.4 MB) no longer fit in L2. A
//! [`BlockPool`](super::pool::BlockPool) therefore maps its blocks' memory in one region per
//! [`grow`](super::pool::BlockPool::grow), advised with `MADV_HUGEPAGE` so the kernel backs it
//! with 2 MiB pages where it can (the global allocator cannot be asked for them). Measured at
//! that batch, the gain is small: attention 166 ms per step on heap blocks, 155-159 here.
//!
//! Each block owns a [`Slab`]: a slice of a region plus a share of it. Dropping a slab hands
//! its whole pages back to the system at once (`MADV_DONTNEED`), so shrinking a pool frees
//! memory as separate allocations did; the region is unmapped when its last slab goes.

use std::ptr::NonNull;
use std::sync::Arc;

/// Element types whose all-zero bytes are a valid value (a fresh mapping reads as zeros).
pub trait Zeroable: Copy + Send + Sync + 'static {}
impl Zeroable for f32 {}
impl Zeroable for half::f16 {}
impl Zeroable for i8 {}

const PAGE: usize = 4096;

/// One anonymous mapping, unmapped on drop.
struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the region is plain memory; the slabs carved from it are disjoint, and each is
// accessed through its owner's `&`/`&mut` only.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// The region of slabs of no bytes: nothing mapped.
    const EMPTY: Region = Region {
        ptr: NonNull::dangling(),
        len: 0,
    };

    /// `len` zeroed bytes (`len > 0`), resident when this returns.
    fn map(len: usize) -> Self {
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let Some(ptr) = NonNull::new(ptr as *mut u8).filter(|_| ptr != libc::MAP_FAILED) else {
            // What `Vec` does when the system has no memory left.
            let layout = std::alloc::Layout::from_size_align(len, PAGE)
                .unwrap_or(std::alloc::Layout::new::<u8>());
            std::alloc::handle_alloc_error(layout)
        };
        // SAFETY: the range is the mapping just made. Refusal (no THP in this kernel) only
        // leaves the region on 4 KiB pages.
        unsafe {
            libc::madvise(ptr.as_ptr() as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        // Fault every page in now, as zeroing a heap allocation did: the memory budget counts
        // these bytes as held from this point, and a step should not take the faults.
        for at in (0..len).step_by(PAGE) {
            // SAFETY: `at < len`, inside the mapping.
            unsafe { std::ptr::write_volatile(ptr.as_ptr().add(at), 0) };
        }
        Self { ptr, len }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: the mapping made in `map`; no slab outlives its share of the region.
        unsafe {
            libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len);
        }
    }
}

/// `len` values of `T` inside a region, owned alone.
pub struct Slab<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
    region: Arc<Region>,
}

// SAFETY: a slab is the only handle to its values (see `Region`), like a `Box<[T]>`.
unsafe impl<T: Zeroable> Send for Slab<T> {}
unsafe impl<T: Zeroable> Sync for Slab<T> {}

impl<T: Zeroable> Slab<T> {
    /// `n` zeroed slabs of `len` values each, carved from one new region.
    pub fn many(n: usize, len: usize) -> Vec<Self> {
        let bytes = len * std::mem::size_of::<T>();
        if n == 0 {
            return Vec::new();
        }
        let region = Arc::new(if bytes == 0 {
            Region::EMPTY
        } else {
            Region::map(n * bytes)
        });
        (0..n)
            .map(|i| Self {
                ptr: if bytes == 0 {
                    NonNull::dangling()
                } else {
                    // SAFETY: `i * bytes + bytes <= n * bytes`, inside the region. Slabs start
                    // at multiples of their size in a page-aligned region, and `bytes` is a
                    // multiple of `size_of::<T>()`, so `T`'s alignment holds.
                    unsafe { NonNull::new_unchecked(region.ptr.as_ptr().add(i * bytes) as *mut T) }
                },
                len,
                region: Arc::clone(&region),
            })
            .collect()
    }
}

impl<T: Zeroable> std::ops::Deref for Slab<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised values (zeroed at mapping) owned by this slab.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> std::ops::DerefMut for Slab<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> Drop for Slab<T> {
    fn drop(&mut self) {
        // Hand the whole pages inside this slab back now, while the region lives on in other
        // blocks (the last one unmaps it all). They would read as zeros if touched again,
        // which no one does: the slab is gone. Two last slabs dropped at once may both do it,
        // which is harmless.
        if Arc::strong_count(&self.region) == 1 {
            return;
        }
        let start = self.ptr.as_ptr() as usize;
        let end = start + self.len * std::mem::size_of::<T>();
        let (lo, hi) = (start.next_multiple_of(PAGE), end / PAGE * PAGE);
        if self.region.len > 0 && hi > lo {
            // SAFETY: whole pages inside this slab's own range, which nothing else uses.
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slabs_are_disjoint_zeroed_and_writable() {
        let mut slabs = Slab::<f32>::many(5, 3072);
        assert_eq!(slabs.len(), 5);
        for (i, s) in slabs.iter_mut().enumerate() {
            assert_eq!(s.len(), 3072);
            assert!(s.iter().all(|&v| v == 0.0));
            s.fill(i as f32);
        }
        for (i, s) in slabs.iter().enumerate() {
            assert!(s.iter().all(|&v| v == i as f32), "slab {i}");
        }
        // Dropping some leaves the others' values in place.
        slabs.drain(1..3);
        assert_eq!(slabs[0][0], 0.0);
        assert_eq!(slabs[1][3071], 3.0);
        assert_eq!(slabs[2][17], 4.0);
        assert!(Slab::<i8>::many(0, 16).is_empty());
        assert!(Slab::<f32>::many(2, 0).iter().all(|s| s.is_empty()));
        let odd = Slab::<half::f16>::many(3, 5);
        assert!(odd
            .iter()
            .all(|s| s.len() == 5 && s.iter().all(|v| *v == half::f16::ZERO)));
    }
}
