//! Orders that policies change: DeepIO's opportunistic substitution and Yang and Cong's
//! locality-aware reassignment within global batches.

use super::*;

/// DeepIO's opportunistic choice for `node` at (`epoch`, `pos`): a list of cached samples (any
/// node's with peers, else the node's own), the node whose list it is, and an index in it, by a
/// hash of the three.
#[inline]
pub(super) fn substitute_pick<T>(
    cached: &[Vec<T>],
    peers: bool,
    node: usize,
    epoch: u32,
    pos: usize,
) -> Option<(usize, &[T], usize)> {
    let h = splitmix64(((epoch as u64) << 32) ^ ((node as u64) << 48) ^ pos as u64);
    let (owner, list) = if peers {
        let lists = || cached.iter().enumerate().filter(|(_, c)| !c.is_empty());
        let n = lists().count();
        lists().nth((h % n.max(1) as u64) as usize)?
    } else {
        Some((node, &cached[node])).filter(|(_, c)| !c.is_empty())?
    };
    Some((owner, list, (splitmix64(h) % list.len() as u64) as usize))
}

/// Yang and Cong's reordering: every global batch keeps its samples and every worker its batch
/// size, but a sample cached on a node goes to a worker of that node while it has room; the
/// rest fill the remaining places in order.
pub(super) fn locality_reassign(streams: &[RankEpoch], held: &[Held], wpn: usize) -> Vec<RankEpoch> {
    let workers = streams.len();
    let nb = streams[0].batch_ends.len();
    let mut out: Vec<RankEpoch> = streams
        .iter()
        .map(|s| RankEpoch {
            samples: Vec::with_capacity(s.samples.len()),
            batch_ends: Vec::with_capacity(nb),
        })
        .collect();
    // Owners gathered first, in one pass (the lookups are random; this way they overlap).
    let owners: Vec<Vec<u32>> = streams
        .iter()
        .map(|s| s.samples.iter().map(|&k| held[k as usize].owner()).collect())
        .collect();
    let mut room = vec![0usize; workers];
    let mut rest = Vec::new();
    for b in 0..nb {
        rest.clear();
        for (w, s) in streams.iter().enumerate() {
            let start = if b == 0 { 0 } else { s.batch_ends[b - 1] as usize };
            room[w] = s.batch_ends[b] as usize - start;
        }
        for (s, own) in streams.iter().zip(&owners) {
            let start = if b == 0 { 0 } else { s.batch_ends[b - 1] as usize };
            let end = s.batch_ends[b] as usize;
            for (&k, &o) in s.samples[start..end].iter().zip(&own[start..end]) {
                let target = if o == NONE {
                    None
                } else {
                    (o as usize * wpn..(o as usize + 1) * wpn).find(|&w| room[w] > 0)
                };
                match target {
                    Some(w) => {
                        room[w] -= 1;
                        out[w].samples.push(k);
                    }
                    None => rest.push(k),
                }
            }
        }
        let mut w = 0;
        for &k in &rest {
            while room[w] == 0 {
                w += 1;
            }
            room[w] -= 1;
            out[w].samples.push(k);
        }
        for o in out.iter_mut() {
            o.batch_ends.push(o.samples.len() as u32);
        }
    }
    out
}
