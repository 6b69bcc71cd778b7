//! Coalescing of nearby byte ranges into fewer reads.

use std::ops::Range;

/// One read that serves several requested ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Span {
    pub range: Range<u64>,
    /// Indices (into the requested ranges) that this span serves.
    pub members: Vec<usize>,
}

/// Groups `ranges` into spans, merging a range into the previous span when it starts no more
/// than `gap_bytes` past that span's end. Empty ranges join whatever span they fall next to.
pub(crate) fn coalesce(ranges: &[Range<u64>], gap_bytes: u64) -> Vec<Span> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| (ranges[i].start, ranges[i].end));
    let mut spans: Vec<Span> = Vec::new();
    for i in order {
        let r = &ranges[i];
        match spans.last_mut() {
            Some(s) if r.start <= s.range.end.saturating_add(gap_bytes) => {
                s.range.end = s.range.end.max(r.end);
                s.members.push(i);
            }
            _ => spans.push(Span { range: r.clone(), members: vec![i] }),
        }
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(ranges: &[Range<u64>], gap: u64, expect: &[(Range<u64>, &[usize])]) {
        let got = coalesce(ranges, gap);
        let got: Vec<(Range<u64>, Vec<usize>)> = got.into_iter().map(|s| (s.range, s.members)).collect();
        let expect: Vec<(Range<u64>, Vec<usize>)> = expect.iter().map(|(r, m)| (r.clone(), m.to_vec())).collect();
        assert_eq!(got, expect);
    }

    #[test]
    fn coalesces_close_ranges_in_offset_order() {
        check(&[10..20, 0..5, 100..110], 4, &[(0..5, &[1]), (10..20, &[0]), (100..110, &[2])]);
        check(&[10..20, 0..5, 100..110], 10, &[(0..20, &[1, 0]), (100..110, &[2])]);
        check(&[0..50, 10..20], 0, &[(0..50, &[0, 1])]);
        check(&[], 0, &[]);
    }
}
