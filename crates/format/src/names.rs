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

/// Whether `id` can be a save id: 16 hexadecimal digits. A save id begins every data
/// file's name, and only names of that exact shape are ever removed as an old or failed
/// save's files, so that nothing a user put beside a checkpoint (`model-00001.safetensors`)
/// can be taken for one.
pub fn is_save_id(id: &str) -> bool {
    id.len() == SAVE_ID_DIGITS && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Digits of a save id.
pub const SAVE_ID_DIGITS: usize = 16;

/// Whether `name` is a data file name dckpt makes: `<16 hex>-<5+ digits>.safetensors`, or
/// `<16 hex>-<5+ digits>.<digits>.safetensors` for a rank's further files. Only such names
/// are ever removed as an old or failed save's files, whatever a metadata file names.
pub fn is_data_file_name(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let Some(stem) = name.strip_suffix(".safetensors") else { return false };
    let Some((id, rest)) = stem.split_once('-') else { return false };
    let (rank, file) = rest.split_once('.').unwrap_or((rest, "0"));
    is_save_id(id) && rank.len() >= 5 && digits(rank) && digits(file)
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
        }
    }
}
