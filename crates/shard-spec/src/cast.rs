//! Floating-point casts between f16, bf16, f32 and f64, bit-exact with PyTorch's
//! `tensor.to(dtype)` on CPU: round to nearest, ties to even, overflow to infinity,
//! subnormals kept. A cast from f64 rounds to f32 first, as PyTorch does; a cast to f64
//! goes through f32, which holds every f16, bf16 and f32 value exactly.
//!
//! NaNs come out as PyTorch's vectorized CPU kernels write them (PyTorch itself writes other
//! NaN bits for the same cast on some paths, e.g. a one-element f16 tensor cast to f32):
//! a NaN cast to bf16 is `0xffff`, except from f16, where it is `0x7fc0`; cast to f16 it
//! keeps its sign and the top of its payload, quieted (what the F16C instruction does); an
//! f16 NaN cast to f32 keeps sign and payload, quieted; a bf16 one keeps every bit.
//!
//! Exports cast with these (`dckpt export --dtype`), and loads that allow it cast from the
//! stored dtype to the requested one (`torch_dist` loads an fp32 checkpoint into bf16
//! parameters the same way).

use crate::DType;

/// Whether elements of `from` can be cast to `to` here: both are f16, bf16, f32 or f64.
pub fn can_cast(from: DType, to: DType) -> bool {
    let float = |d: DType| matches!(d, DType::F16 | DType::Bf16 | DType::F32 | DType::F64);
    float(from) && float(to)
}

/// `f32` to bf16 bits.
pub fn f32_to_bf16(x: f32) -> u16 {
    if x.is_nan() {
        return 0xffff;
    }
    let u = x.to_bits();
    let bias = ((u >> 16) & 1) + 0x7fff;
    (u.wrapping_add(bias) >> 16) as u16
}

/// bf16 bits to `f32` (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// `f32` to IEEE half bits.
pub fn f32_to_f16(x: f32) -> u16 {
    let u = x.to_bits();
    let sign = ((u >> 16) & 0x8000) as u16;
    let exp = ((u >> 23) & 0xff) as i32;
    let man = u & 0x7f_ffff;
    if exp == 0xff {
        return sign | if man != 0 { 0x7e00 | (man >> 13) as u16 } else { 0x7c00 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        // A subnormal half (or zero): below half the smallest one everything rounds to zero.
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let (mut r, rem) = (m >> shift, m & ((1 << shift) - 1));
        if rem > half || (rem == half && r & 1 == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let mut r = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1fff;
    // A carry out of the mantissa moves into the exponent, up to infinity: still correct.
    if rem > 0x1000 || (rem == 0x1000 && r & 1 == 1) {
        r += 1;
    }
    sign | r as u16
}

/// IEEE half bits to `f32` (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            let (mut e, mut m) = (113u32, man);
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        // A NaN: quieted, as PyTorch's vectorized f16 -> f32 cast does.
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Casts the elements of `input` (dtype `from`, little-endian) into `out` (dtype `to`).
/// [`can_cast`] holds for the two and the lengths agree: `input.len() / from.size() ==
/// out.len() / to.size()`.
pub fn cast_into(from: DType, to: DType, input: &[u8], out: &mut [u8]) {
    debug_assert_eq!(input.len() / from.size() as usize, out.len() / to.size() as usize);
    if from == to {
        out.copy_from_slice(input);
        return;
    }
    // One loop per pair of dtypes, each element read and written without a branch on them:
    // a load casting gigabytes runs at memory speed rather than at a match per element.
    match from {
        DType::F32 => write_as(to, input, out, |b: [u8; 4]| f32::from_le_bytes(b)),
        DType::Bf16 => write_as(to, input, out, |b: [u8; 2]| bf16_to_f32(u16::from_le_bytes(b))),
        // PyTorch's f16 -> bf16 kernel writes the canonical NaN.
        DType::F16 if to == DType::Bf16 => each(input, out, |b: [u8; 2]| {
            let x = f16_to_f32(u16::from_le_bytes(b));
            if x.is_nan() { 0x7fc0u16 } else { f32_to_bf16(x) }.to_le_bytes()
        }),
        DType::F16 => write_as(to, input, out, |b: [u8; 2]| f16_to_f32(u16::from_le_bytes(b))),
        DType::F64 => write_as(to, input, out, |b: [u8; 8]| f64::from_le_bytes(b) as f32),
        _ => unreachable!("only floating dtypes are cast"),
    }
}

/// The elements read by `read` written as `to`.
fn write_as<const F: usize>(to: DType, input: &[u8], out: &mut [u8], read: impl Fn([u8; F]) -> f32) {
    match to {
        DType::F32 => each(input, out, |b| read(b).to_le_bytes()),
        DType::Bf16 => each(input, out, |b| f32_to_bf16(read(b)).to_le_bytes()),
        DType::F16 => each(input, out, |b| f32_to_f16(read(b)).to_le_bytes()),
        DType::F64 => each(input, out, |b| f64::from(read(b)).to_le_bytes()),
        _ => unreachable!("only floating dtypes are cast"),
    }
}

fn each<const F: usize, const T: usize>(input: &[u8], out: &mut [u8], f: impl Fn([u8; F]) -> [u8; T]) {
    for (i, o) in input.chunks_exact(F).zip(out.chunks_exact_mut(T)) {
        o.copy_from_slice(&f(i.try_into().expect("a chunk of F bytes")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trips_every_value_through_f32() {
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            let back = f32_to_f16(x);
            if x.is_nan() {
                assert!(f16_to_f32(back).is_nan(), "{h:#x}");
                assert_eq!(back & 0x8000, h & 0x8000);
            } else {
                assert_eq!(back, h, "{h:#x} -> {x:e} -> {back:#x}");
            }
        }
    }

    #[test]
    fn bf16_round_trips_every_value_through_f32() {
        for h in 0..=u16::MAX {
            let x = bf16_to_f32(h);
            if !x.is_nan() {
                assert_eq!(f32_to_bf16(x), h, "{h:#x}");
            }
        }
    }

    /// Values whose results PyTorch 2.x gives (`torch.tensor([...]).to(dtype)`).
    #[test]
    fn known_values_round_as_pytorch_does() {
        let bf = |x: f32| f32_to_bf16(x);
        assert_eq!(bf(1.0), 0x3f80);
        assert_eq!(bf(f32::from_bits(0x3f80_8000)), 0x3f80, "a tie rounds to even (down)");
        assert_eq!(bf(f32::from_bits(0x3f81_8000)), 0x3f82, "a tie rounds to even (up)");
        assert_eq!(bf(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bf(f32::MAX), 0x7f80, "the largest f32 rounds to infinity");
        assert_eq!(bf(f32::INFINITY), 0x7f80);
        assert_eq!(bf(f32::NEG_INFINITY), 0xff80);
        assert_eq!(bf(f32::NAN), 0xffff);
        assert_eq!(bf(-0.0), 0x8000);
        assert_eq!(bf(f32::from_bits(1)), 0x0000, "the smallest subnormal rounds to zero");
        assert_eq!(bf(f32::from_bits(0x0000_8000)), 0x0000, "a subnormal tie rounds to even");
        assert_eq!(bf(f32::from_bits(0x0001_8000)), 0x0002);

        let h = |x: f32| f32_to_f16(x);
        assert_eq!(h(1.0), 0x3c00);
        assert_eq!(h(65504.0), 0x7bff);
        assert_eq!(h(65520.0), 0x7c00, "halfway past the largest half rounds to infinity");
        assert_eq!(h(65519.996), 0x7bff);
        assert_eq!(h(1e9), 0x7c00);
        assert_eq!(h(-1e9), 0xfc00);
        assert_eq!(h(f32::NAN), 0x7e00);
        assert_eq!(h(f32::from_bits(0xffc1_2345)), 0xfe09, "a NaN keeps its sign and payload top");
        assert_eq!(h(f32::from_bits(0x7f80_0001)), 0x7e00, "a signalling NaN is quieted");
        assert_eq!(h(2f32.powi(-24)), 0x0001, "the smallest subnormal half");
        assert_eq!(h(2f32.powi(-25)), 0x0000, "half of it: a tie, to even");
        assert_eq!(h(2f32.powi(-25) * 1.0001), 0x0001);
        assert_eq!(h(3.0 * 2f32.powi(-25)), 0x0002, "1.5 of the smallest: a tie, to even");
        assert_eq!(h(2f32.powi(-14)), 0x0400, "the smallest normal half");
        assert_eq!(h(2f32.powi(-14) - 2f32.powi(-25)), 0x0400, "rounds up out of the subnormals");
        assert_eq!(h(1.0 + 2f32.powi(-11)), 0x3c00, "a tie to even (down)");
        assert_eq!(h(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02, "a tie to even (up)");
        assert_eq!(h(-0.0), 0x8000);

        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
    }

    #[test]
    fn casts_from_f64_round_to_f32_first() {
        // 1 + 2^-8 + 2^-40: directly it would round up to 0x3f81; through f32 the 2^-40 is
        // gone and the tie goes to even, 0x3f80, which is what PyTorch writes.
        let x = 1.0f64 + 2f64.powi(-8) + 2f64.powi(-40);
        let mut out = [0u8; 2];
        cast_into(DType::F64, DType::Bf16, &x.to_le_bytes(), &mut out);
        assert_eq!(u16::from_le_bytes(out), 0x3f80);
    }

    /// NaN bits as PyTorch 2.15's CPU casts of 100-element tensors write them.
    #[test]
    fn nans_come_out_as_pytorch_writes_them() {
        let cast = |from: DType, to: DType, bits: u64| -> u64 {
            let input = &bits.to_le_bytes()[..from.size() as usize];
            let mut out = vec![0u8; to.size() as usize];
            cast_into(from, to, input, &mut out);
            out.iter().rev().fold(0, |v, &b| v << 8 | u64::from(b))
        };
        for (from, to, input, want) in [
            (DType::F32, DType::Bf16, 0xffc1_2345, 0xffff),
            (DType::F32, DType::F16, 0x7fbf_ffff, 0x7fff),
            (DType::F16, DType::F32, 0x7c01, 0x7fc0_2000),
            (DType::F16, DType::F32, 0xfe09, 0xffc1_2000),
            (DType::F16, DType::Bf16, 0xfe09, 0x7fc0),
            (DType::Bf16, DType::F32, 0x7f81, 0x7f81_0000),
            (DType::Bf16, DType::F16, 0x7fbf, 0x7ff8),
            (DType::F64, DType::F32, 0xfff8_1234_5678_9abc, 0xffc0_91a2),
            (DType::F64, DType::F16, 0xfff8_1234_5678_9abc, 0xfe04),
            (DType::F64, DType::Bf16, 0x7ff0_0000_0000_0001, 0xffff),
        ] {
            assert_eq!(cast(from, to, input), want, "{from} {input:#x} -> {to}");
        }
    }

    /// Each pair's loop casts every element of a buffer as the element functions do: all
    /// 65,536 halves and bfloat16s, and f32s and f64s spread over every exponent.
    #[test]
    fn every_pair_casts_a_buffer_element_by_element() {
        let floats = [DType::F16, DType::Bf16, DType::F32, DType::F64];
        let values: Vec<f64> = (0..=u16::MAX)
            .flat_map(|h| [f64::from(f16_to_f32(h)), f64::from(bf16_to_f32(h))])
            .chain((0..4096u64).map(|i| f64::from_bits(i.wrapping_mul(0x9e37_79b9_7f4a_7c15))))
            .collect();
        let write = |d: DType, x: f64| -> Vec<u8> {
            match d {
                DType::F16 => f32_to_f16(x as f32).to_le_bytes().to_vec(),
                DType::Bf16 => f32_to_bf16(x as f32).to_le_bytes().to_vec(),
                DType::F32 => (x as f32).to_le_bytes().to_vec(),
                _ => x.to_le_bytes().to_vec(),
            }
        };
        for from in floats {
            let input: Vec<u8> = values.iter().flat_map(|&x| write(from, x)).collect();
            for to in floats {
                let mut out = vec![0u8; values.len() * to.size() as usize];
                cast_into(from, to, &input, &mut out);
                let fs = from.size() as usize;
                for (k, (i, o)) in input.chunks(fs).zip(out.chunks(to.size() as usize)).enumerate() {
                    let x = match from {
                        DType::F16 => f64::from(f16_to_f32(u16::from_le_bytes([i[0], i[1]]))),
                        DType::Bf16 => f64::from(bf16_to_f32(u16::from_le_bytes([i[0], i[1]]))),
                        DType::F32 => f64::from(f32::from_le_bytes(i.try_into().unwrap())),
                        _ => f64::from(f64::from_le_bytes(i.try_into().unwrap()) as f32),
                    };
                    if !x.is_nan() && from != to {
                        assert_eq!(o, write(to, x), "{from} -> {to}, element {k}: {x:e}");
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_to_f16_goes_through_f32() {
        let input: Vec<u8> = [0x3f80u16, 0x4780, 0x0001].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![0u8; 6];
        cast_into(DType::Bf16, DType::F16, &input, &mut out);
        let got: Vec<u16> = out.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        // 1.0; 65536 overflows half; a tiny bf16 subnormal is zero in half.
        assert_eq!(got, [0x3c00, 0x7c00, 0x0000]);
    }
}
