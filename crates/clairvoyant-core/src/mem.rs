//! Large sample-indexed tables: allocation on huge pages and prefetch hints for random access.

/// A vector of `n` copies of `value`, backed by transparent huge pages where the kernel allows:
/// tables indexed by sample are read and written at random, and huge pages spare most of their
/// TLB misses.
pub fn huge_vec<T: Clone>(n: usize, value: T) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    advise_huge(v.as_ptr(), n);
    v.resize(n, value);
    v
}

/// `(0..n)` as a vector on huge pages (see [`huge_vec`]).
pub fn huge_iota(n: u32) -> Vec<u32> {
    let mut v: Vec<u32> = Vec::with_capacity(n as usize);
    advise_huge(v.as_ptr(), n as usize);
    v.extend(0..n);
    v
}

/// Ask for huge pages over the allocation of `n` values of `T` at `start`.
fn advise_huge<T>(start: *const T, n: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = start as usize;
        let len = n * std::mem::size_of::<T>();
        let aligned = start.next_multiple_of(HUGE);
        if len >= 2 * HUGE && aligned < start + len {
            // SAFETY: advice on pages inside this vector's own allocation (its capacity covers
            // `len` bytes); it changes no contents.
            unsafe {
                libc::madvise(aligned as *mut libc::c_void, start + len - aligned, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, n);
}

/// Hint that `v[i]` will be read soon (nothing if `i` is out of range).
#[inline(always)]
pub fn prefetch<T>(v: &[T], i: usize) {
    #[cfg(target_arch = "x86_64")]
    if i < v.len() {
        // SAFETY: a prefetch hint for an address inside the slice; it reads and changes nothing.
        unsafe {
            std::arch::x86_64::_mm_prefetch(v.as_ptr().add(i) as *const i8, std::arch::x86_64::_MM_HINT_T0);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (v, i);
}
