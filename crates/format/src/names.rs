//! The names of a checkpoint's objects (`docs/format.md`, section 1): the metadata file,
//! the data files, and the plain-name rule every name in a metadata file must follow.

/// The metadata file's name inside a checkpoint.
pub const META_NAME: &str = "dckpt.meta";

/// Longest file name (and save id) a reader accepts.
pub const FILE_NAME_BYTES_MAX: usize = 255;

/// The name of `rank`'s data file number `file` in save `save_id`:
/// `<save_id>-<rank>.safetensors` for the first, `<save_id>-<rank>.<file>.safetensors` for
/// any further ones, the rank zero-padded to 5 digits.
pub fn data_file_name(save_id: &str, rank: usize, file: usize) -> String {
    match file {
        0 => format!("{save_id}-{rank:05}.safetensors"),
        _ => format!("{save_id}-{rank:05}.{file}.safetensors"),
    }
}

/// Whether `id` can be a save id: 16 lower-case hexadecimal digits (what a save draws at
/// random, and the shape a given one must have). A save id begins every data file's name,
/// and only names of that exact shape are ever removed as an old or failed save's files, so
/// that nothing a user put beside a checkpoint (`model-00001.safetensors`) can be taken for
/// one.
pub fn is_save_id(id: &str) -> bool {
    id.len() == SAVE_ID_DIGITS && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Digits of a save id.
pub const SAVE_ID_DIGITS: usize = 16;

/// Whether `name` is a data file name of the shape dckpt makes: `<16 hex>-<5+
/// digits>.safetensors`, or `<16 hex>-<5+ digits>.<digits>.safetensors` for a rank's further
/// files (hex in lower case). Only such names are ever removed as an old or failed save's
/// files, whatever a metadata file names. It is looser than [`parse_data_file_name`]: a
/// leftover need not be a name dckpt would make today to be recognised as one.
pub fn is_data_file_name(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let Some(stem) = name.strip_suffix(".safetensors") else { return false };
    let Some((id, rest)) = stem.split_once('-') else { return false };
    let (rank, file) = rest.split_once('.').unwrap_or((rest, "0"));
    is_save_id(id) && rank.len() >= 5 && digits(rank) && digits(file)
}

/// What a data file's name says: whose file it is and which of that rank's files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataFileName<'a> {
    /// The save id the name starts with.
    pub save_id: &'a str,
    /// The rank that wrote it.
    pub rank: u64,
    /// Its number among the rank's files (0 for the first, which carries no number).
    pub file: u64,
}

/// The save id, rank and file number of `name` when it is exactly what [`data_file_name`]
/// makes for them: a lower-case save id, the rank zero-padded to 5 digits and no more, the
/// file number from 1 without leading zeros (absent for file 0). `None` for anything else,
/// so that a renamed data file is told apart from the one the metadata should name.
pub fn parse_data_file_name(name: &str) -> Option<DataFileName<'_>> {
    // A number as written by `{:05}` (`pad` 5) or `{}` (`pad` 1): no leading zero beyond
    // the padding, so that every number has exactly one spelling.
    fn number(s: &str, pad: usize) -> Option<u64> {
        if s.len() < pad || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > pad && s.starts_with('0')) {
            return None;
        }
        s.parse().ok()
    }
    let stem = name.strip_suffix(".safetensors")?;
    let (save_id, rest) = stem.split_once('-')?;
    if !is_save_id(save_id) {
        return None;
    }
    let (rank, file) = match rest.split_once('.') {
        Some((rank, file)) => (number(rank, 5)?, number(file, 1).filter(|&n| n > 0)?),
        None => (number(rest, 5)?, 0),
    };
    Some(DataFileName { save_id, rank, file })
}

/// A data file or save id name: 1 to [`FILE_NAME_BYTES_MAX`] bytes of `[A-Za-z0-9._-]`, not
/// starting with `.`, so it can name nothing outside the checkpoint. The error says why.
pub fn check_plain_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > FILE_NAME_BYTES_MAX {
        return Err(format!("{name:?} must be 1 to {FILE_NAME_BYTES_MAX} bytes"));
    }
    if name.starts_with('.') || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return Err(format!("{name:?} is not a plain file name ([A-Za-z0-9._-], not starting with '.')"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_that_are_not_data_files() {
        for name in [
            META_NAME,
            "0123456789abcdef-0001.safetensors",    // rank too short
            "0123456789abcde-00001.safetensors",    // id too short
            "0123456789abcdeg-00001.safetensors",   // not hex
            "0123456789ABCDEF-00001.safetensors",   // upper-case hex
            "0123456789abcdef-00001.safetensors.x", // other suffix
            "0123456789abcdef-00001..safetensors",  // empty file number
            "0123456789abcdef-00001.a.safetensors",
            "dir/0123456789abcdef-00001.safetensors",
            "model.safetensors",
            "",
        ] {
            assert!(!is_data_file_name(name), "{name:?}");
        }
    }

    #[test]
    fn save_ids_are_lower_case_hex() {
        assert!(is_save_id("0123456789abcdef"));
        for bad in
            ["0123456789ABCDEF", "0123456789abcdeF", "0123456789abcde", "0123456789abcdef0", "0123456789abcdeg", ""]
        {
            assert!(!is_save_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn data_file_names_parse_only_as_made() {
        let id = "0123456789abcdef";
        let parsed = |rank, file| Some(DataFileName { save_id: id, rank, file });
        assert_eq!(parse_data_file_name("0123456789abcdef-00003.safetensors"), parsed(3, 0));
        assert_eq!(parse_data_file_name("0123456789abcdef-00003.12.safetensors"), parsed(3, 12));
        assert_eq!(parse_data_file_name("0123456789abcdef-123456.safetensors"), parsed(123456, 0));
        for other in [
            "0123456789abcdef-0003.safetensors",     // rank not padded
            "0123456789abcdef-000003.safetensors",   // padded beyond 5 digits
            "0123456789abcdef-00003.0.safetensors",  // file 0 carries no number
            "0123456789abcdef-00003.01.safetensors", // a leading zero
            "0123456789abcdef-00003.x.safetensors",
            "0123456789abcdef-00003.1.2.safetensors",
            "0123456789ABCDEF-00003.safetensors",
            "0123456789abcdef-99999999999999999999999.safetensors", // past u64
            "0123456789abcdef_00003.safetensors",
            "model-00001-of-00002.safetensors",
        ] {
            assert_eq!(parse_data_file_name(other), None, "{other:?}");
        }
    }

    #[test]
    fn plain_names() {
        for good in ["a", "0123456789abcdef-00001.safetensors", "A.b_c-d", &"x".repeat(255)] {
            assert_eq!(check_plain_name(good), Ok(()), "{good:?}");
        }
        for bad in ["", ".", "..", ".hidden", "a/b", "a\\b", "/etc", "x\0y", "é", &"x".repeat(256)] {
            assert!(check_plain_name(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        /// Every name a save makes is recognised as a data file and is a plain name.
        #[test]
        fn made_names_are_recognised(id in "[0-9a-f]{16}", rank in 0..2_000_000usize, file in 0..1000usize) {
            let name = data_file_name(&id, rank, file);
            prop_assert!(is_data_file_name(&name), "{}", name);
            prop_assert_eq!(check_plain_name(&name), Ok(()));
            prop_assert_eq!(name.contains(&format!(".{file}.")), file > 0);
            let parsed = DataFileName { save_id: &id, rank: rank as u64, file: file as u64 };
            prop_assert_eq!(parse_data_file_name(&name), Some(parsed));
        }
    }
}
