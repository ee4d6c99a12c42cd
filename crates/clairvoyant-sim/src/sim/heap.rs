//! The simulation's clocks: the event key (time, then actor), a branch-free binary min-heap of
//! such keys, and the earliest of a few times.

use super::*;

/// Actor `id` (a pool of threads) is free at time `t`; the heap pops the earliest first, ties
/// by lowest id.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ev {
    pub(super) t: f64,
    pub(super) id: u32,
}

impl Ev {
    /// The heap key: times are non-negative (or infinite), so their bit patterns order like
    /// the numbers; ties go to the lowest id. One integer comparison, no branches on floats.
    #[inline]
    pub(super) fn key(self) -> u128 {
        debug_assert!(self.t >= 0.0, "event times are never negative");
        ((self.t.to_bits() as u128) << 32) | self.id as u128
    }

    #[inline]
    pub(super) fn from_key(k: u128) -> Ev {
        Ev {
            t: f64::from_bits((k >> 32) as u64),
            id: k as u32,
        }
    }
}

impl PartialEq for Ev {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Ev {}
impl PartialOrd for Ev {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Ev {
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.id.cmp(&self.id))
    }
}

/// The index of the earliest of some times (the first on ties, as `Iterator::min_by`) and
/// that time; written without data-dependent branches (the times are unpredictable).
#[inline]
pub(super) fn argmin(v: &[f64]) -> (usize, f64) {
    let mut best = (0, v[0]);
    for (i, &x) in v.iter().enumerate().skip(1) {
        let better = x < best.1;
        best.0 = if better { i } else { best.0 };
        best.1 = if better { x } else { best.1 };
    }
    best
}

/// A binary min-heap of integer keys (bit patterns of non-negative f64, which order like the
/// numbers, possibly with an id below them). `std::collections::BinaryHeap` chooses between
/// children with a branch that the CPU cannot predict (the times are random); choosing with a
/// conditional move cuts the cost of the event and PFS queues by about a third of the whole
/// simulation's. Keys pop in the same order, so results do not change.
pub(super) struct MinHeap<T> {
    v: Vec<T>,
}

impl<T> Default for MinHeap<T> {
    fn default() -> Self {
        MinHeap { v: Vec::new() }
    }
}

impl<T: std::marker::Copy + Ord> MinHeap<T> {
    #[inline]
    pub(super) fn len(&self) -> usize {
        self.v.len()
    }

    #[inline]
    pub(super) fn peek(&self) -> Option<T> {
        self.v.first().copied()
    }

    /// Replace the smallest key by `x` (what `BinaryHeap::peek_mut` does).
    pub(super) fn replace_top(&mut self, x: T) {
        let n = self.v.len();
        assert!(n > 0, "replace_top on an empty heap");
        let mut i = 0;
        let mut child = 1;
        while child + 1 < n {
            child += (self.v[child + 1] < self.v[child]) as usize;
            if x <= self.v[child] {
                break;
            }
            self.v[i] = self.v[child];
            i = child;
            child = 2 * i + 1;
        }
        if child + 1 == n && self.v[child] < x {
            self.v[i] = self.v[child];
            i = child;
        }
        self.v[i] = x;
    }

    pub(super) fn push(&mut self, x: T) {
        self.v.push(x);
        let mut i = self.v.len() - 1;
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.v[parent] <= x {
                break;
            }
            self.v[i] = self.v[parent];
            i = parent;
        }
        self.v[i] = x;
    }

    /// Remove the smallest: the hole at the root moves down to a leaf along the smaller
    /// children (branch-free choice), then the last element fills it and moves up.
    pub(super) fn pop(&mut self) -> Option<T> {
        let top = *self.v.first()?;
        let last = self.v.pop().expect("not empty");
        let n = self.v.len();
        if n == 0 {
            return Some(top);
        }
        let mut i = 0;
        let mut child = 1;
        while child + 1 < n {
            child += (self.v[child + 1] < self.v[child]) as usize;
            self.v[i] = self.v[child];
            i = child;
            child = 2 * i + 1;
        }
        if child < n {
            self.v[i] = self.v[child];
            i = child;
        }
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.v[parent] <= last {
                break;
            }
            self.v[i] = self.v[parent];
            i = parent;
        }
        self.v[i] = last;
        Some(top)
    }
}

/// The earliest of some times.
pub(super) fn min_time(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BinaryHeap;

    #[test]
    fn min_heap_pops_like_the_standard_heap() {
        // Random pushes, pops and top replacements on both; the same keys come out in the
        // same order (duplicates included).
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x = splitmix64(x);
            x
        };
        let mut ours: MinHeap<u64> = MinHeap::default();
        let mut std_heap: BinaryHeap<std::cmp::Reverse<u64>> = BinaryHeap::new();
        for _ in 0..200_000 {
            let key = next() % 1000; // many ties
            match next() % 3 {
                0 => {
                    ours.push(key);
                    std_heap.push(std::cmp::Reverse(key));
                }
                1 => assert_eq!(ours.pop(), std_heap.pop().map(|r| r.0)),
                _ if ours.len() > 0 => {
                    ours.replace_top(key);
                    *std_heap.peek_mut().unwrap() = std::cmp::Reverse(key);
                }
                _ => {}
            }
            assert_eq!(ours.peek(), std_heap.peek().map(|r| r.0));
            assert_eq!(ours.len(), std_heap.len());
        }
        while let Some(k) = std_heap.pop() {
            assert_eq!(ours.pop(), Some(k.0));
        }
        assert_eq!(ours.pop(), None);
    }

    #[test]
    fn event_keys_order_by_time_then_id() {
        let e = |t: f64, id: u32| Ev { t, id }.key();
        assert!(e(0.0, 5) < e(0.0, 6));
        assert!(e(1.0, 9) < e(1.5, 0));
        assert!(e(1e300, u32::MAX) < e(f64::INFINITY, 0));
        let back = Ev::from_key(e(2.5, 7));
        assert_eq!((back.t, back.id), (2.5, 7));
    }

    #[test]
    fn argmin_takes_the_first_minimum() {
        assert_eq!(argmin(&[3.0, 1.0, 1.0, 2.0]), (1, 1.0));
        assert_eq!(argmin(&[0.5]), (0, 0.5));
        assert_eq!(argmin(&[f64::INFINITY, 4.0, f64::INFINITY]), (1, 4.0));
    }
}
