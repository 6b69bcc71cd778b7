//! A stable sort by a 64-bit key, one byte at a time from the least significant: linear in
//! the items, one pass to count and one per byte in which the keys differ. A save groups
//! every rank's pieces by a hash of their ids, hundreds of thousands at thousands of ranks,
//! where a comparison sort takes some twenty compares and moves a piece.

/// Sorts `items` by `key`, stably. A byte in which all keys agree is not sorted on; a few
/// items go to the standard sort.
pub(crate) fn sort_by_u64<T: Copy>(items: &mut Vec<T>, key: impl Fn(&T) -> u64) {
    if items.len() <= 64 {
        items.sort_by_key(&key);
        return;
    }
    let n = items.len();
    // Every byte's histogram, from one pass over the keys.
    let mut counts = vec![[0usize; 256]; 8];
    for t in items.iter() {
        let k = key(t);
        for (b, c) in counts.iter_mut().enumerate() {
            c[((k >> (8 * b)) & 0xff) as usize] += 1;
        }
    }
    let mut other = items.clone();
    for (b, c) in counts.iter().enumerate() {
        if c.contains(&n) {
            continue;
        }
        let mut next = [0usize; 256];
        let mut at = 0;
        for (d, &count) in c.iter().enumerate() {
            next[d] = at;
            at += count;
        }
        for t in items.iter() {
            let d = ((key(t) >> (8 * b)) & 0xff) as usize;
            other[next[d]] = *t;
            next[d] += 1;
        }
        std::mem::swap(items, &mut other);
    }
}

/// Sorts `items`, of any type, by `key`, stably: the keys are sorted with their indices as
/// [`sort_by_u64`] sorts them, then each item is swapped into its place along the
/// permutation's cycles, moved once or twice where a comparison sort moves it many times.
pub(crate) fn sort_moving_by_u64<T>(items: &mut [T], key: impl Fn(&T) -> u64) {
    let mut order: Vec<(u64, u32)> = items.iter().enumerate().map(|(i, t)| (key(t), i as u32)).collect();
    sort_by_u64(&mut order, |o| o.0);
    // Where each item goes.
    let mut dest = vec![0u32; items.len()];
    for (to, &(_, from)) in order.iter().enumerate() {
        dest[from as usize] = to as u32;
    }
    drop(order);
    for i in 0..items.len() {
        while dest[i] as usize != i {
            let j = dest[i] as usize;
            items.swap(i, j);
            dest.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same order as the standard library's stable sort, for keys that differ in a few
    /// bytes (most skipped), in all of them, or not at all; items that are not `Copy` too.
    #[test]
    fn sorts_as_the_stable_sort_does() {
        let mut x: u64 = 1;
        let mut next = || {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            x
        };
        for (n, mask) in [(0, u64::MAX), (10, u64::MAX), (1000, u64::MAX), (1000, 0xff00), (5000, 0x3), (300, 0)] {
            let items: Vec<(u64, usize)> = (0..n).map(|i| (next() & mask, i)).collect();
            let mut want = items.clone();
            want.sort_by_key(|t| t.0);
            let mut moved: Vec<(u64, String)> = items.iter().map(|t| (t.0, t.1.to_string())).collect();
            sort_moving_by_u64(&mut moved, |t| t.0);
            let mut got = items;
            sort_by_u64(&mut got, |t| t.0);
            assert_eq!(got, want, "{n} items, mask {mask:x}");
            let want_moved: Vec<(u64, String)> = want.iter().map(|t| (t.0, t.1.to_string())).collect();
            assert_eq!(moved, want_moved, "{n} items moved, mask {mask:x}");
        }
    }
}
