//! Element types.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The element type of a tensor.
///
/// Serialized as its lower-case name (`"bf16"`); [`DType::safetensors_name`] gives the
/// name the safetensors format uses (`"BF16"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    F16,
    Bf16,
    F32,
    F64,
    F8E4m3,
    F8E5m2,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 12] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::Bf16,
        DType::F32,
        DType::F64,
        DType::F8E4m3,
        DType::F8E5m2,
    ];

    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4m3 | DType::F8E5m2 => 1,
            DType::I16 | DType::F16 | DType::Bf16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The lower-case name used on the command line and in dckpt metadata.
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F8E4m3 => "f8_e4m3",
            DType::F8E5m2 => "f8_e5m2",
        }
    }

    /// The dtype string of the safetensors format.
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::I16 => "I16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::F16 => "F16",
            DType::Bf16 => "BF16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::F8E4m3 => "F8_E4M3",
            DType::F8E5m2 => "F8_E5M2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A dtype name that is not one of [`DType::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype {0:?}; expected one of bool, u8, i8, i16, i32, i64, f16, bf16, f32, f64, f8_e4m3, f8_e5m2")]
pub struct UnknownDType(pub String);

impl FromStr for DType {
    type Err = UnknownDType;

    /// Accepts dckpt names (`bf16`), safetensors names (`BF16`) and the common aliases
    /// `fp16`, `fp32`, `fp64`, `float16`, `bfloat16`, `float32`, `float64`, `fp8_e4m3`, `fp8_e5m2`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        let d = match lower.as_str() {
            "bool" => DType::Bool,
            "u8" | "uint8" => DType::U8,
            "i8" | "int8" => DType::I8,
            "i16" | "int16" => DType::I16,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            "f16" | "fp16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::Bf16,
            "f32" | "fp32" | "float32" | "float" => DType::F32,
            "f64" | "fp64" | "float64" | "double" => DType::F64,
            "f8_e4m3" | "fp8_e4m3" | "float8_e4m3fn" | "e4m3" => DType::F8E4m3,
            "f8_e5m2" | "fp8_e5m2" | "float8_e5m2" | "e5m2" => DType::F8E5m2,
            _ => return Err(UnknownDType(s.to_string())),
        };
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
            assert_eq!(d.safetensors_name().parse::<DType>(), Ok(d));
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
        }
        assert_eq!("fp32".parse::<DType>(), Ok(DType::F32));
        assert!("f128".parse::<DType>().is_err());
    }

    #[test]
    fn sizes() {
        let sizes: Vec<u64> = DType::ALL.iter().map(|d| d.size()).collect();
        assert_eq!(sizes, [1, 1, 1, 2, 4, 8, 2, 2, 4, 8, 1, 1]);
    }
}
