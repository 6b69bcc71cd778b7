//! Step directory names and the layout entries a managed save records: the one place that
//! makes and recognises them.

/// The name of the pointer to the latest committed step, under the run root.
pub const LATEST_NAME: &str = "latest";

/// The digits a step number is padded to in its directory's name.
pub const STEP_DIGITS: usize = 12;

/// The layout entry a managed save records its step under.
pub const STEP_ENTRY: &str = "step";

/// The layout entry a managed save records its start under (Unix seconds, from rank 0).
pub const SAVED_AT_ENTRY: &str = "saved_at_unix";

/// The directory of `step` under the run root: `step-000000000042`.
pub fn step_dir(step: u64) -> String {
    format!("step-{step:0width$}", width = STEP_DIGITS)
}

/// The step a directory name stands for, if it is exactly what [`step_dir`] makes (so that
/// one step has one name: `step-42` and `step-0042` are not steps).
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step: u64 = digits.parse().ok()?;
    (step_dir(step) == name).then_some(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_sort_as_numbers_and_parse_back_exactly() {
        assert_eq!(step_dir(42), "step-000000000042");
        let mut names: Vec<String> = [10, 9, 100, 1].iter().map(|&s| step_dir(s)).collect();
        names.sort();
        let parsed: Vec<u64> = names.iter().map(|n| parse_step_dir(n).unwrap()).collect();
        assert_eq!(parsed, [1, 9, 10, 100]);
        assert_eq!(parse_step_dir(&step_dir(u64::MAX)), Some(u64::MAX));
        for bad in ["step-42", "step-0000000000042", "step-", "step-00000000004x", "latest", "step-+00000000042"] {
            assert_eq!(parse_step_dir(bad), None, "{bad}");
        }
    }
}
