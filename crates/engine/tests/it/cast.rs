//! Loads into another floating dtype than the one stored: allowed per request, each stored
//! byte checked, the elements cast as PyTorch casts them, in any layout.

use std::sync::Arc;

use dckpt_collective::{CollectiveOptions, ThreadGroup};
use dckpt_engine::{Engine, LoadOptions, LoadRequest, SaveOptions, SaveState, TensorRequest};
use dckpt_shard_spec::cast::cast_into;
use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
use dckpt_storage::Storage;

const ROWS: u64 = 4;
const COLS: u64 = 6;

/// The f32 elements of the whole [ROWS, COLS] tensor: values that round differently in
/// each target (ties, overflow of half, subnormals, a NaN, a negative zero).
fn elements() -> Vec<f32> {
    let special = [1.0 + 2f32.powi(-8), 65520.0, 1e-40, f32::NAN, -0.0, 1.0 + 3.0 * 2f32.powi(-11)];
    (0..ROWS * COLS).map(|i| special.get(i as usize).copied().unwrap_or(i as f32 * 0.1 - 1.0)).collect()
}

fn bytes_of(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Two ranks save the tensor as f32, each two rows.
fn saved() -> Arc<dyn Storage> {
    let store: Arc<dyn Storage> = dckpt_storage::open("memory://").expect("memory storage");
    let all = elements();
    ThreadGroup::run(2, &CollectiveOptions::default(), |r, c| {
        let t = ShardedTensor {
            key: "w".into(),
            dtype: DType::F32,
            global_shape: [ROWS, COLS].into(),
            region: Region::boxed([r as u64 * 2, 0], [2, COLS]),
            replica_id: ReplicaId::MAIN,
        };
        let rows = bytes_of(&all[r * 2 * COLS as usize..(r + 1) * 2 * COLS as usize]);
        let mut state = SaveState::new();
        state.push_tensor(t, &rows);
        Engine::new(Arc::new(c)).save(store.as_ref(), &state, &SaveOptions::default()).map(|_| ())
    })
    .expect("threads")
    .into_iter()
    .for_each(|r| r.expect("save"));
    store
}

/// Each of two ranks loads its half of the columns as `dtype` (a layout the save did not
/// have: each piece meets both stored chunks), cast where `cast`.
fn load_columns(store: &dyn Storage, dtype: DType, cast: bool) -> Vec<dckpt_engine::Result<Vec<u8>>> {
    ThreadGroup::run(2, &CollectiveOptions::default(), |r, c| {
        let half = COLS / 2;
        let tensor = ShardedTensor {
            key: "w".into(),
            dtype,
            global_shape: [ROWS, COLS].into(),
            region: Region::boxed([0, r as u64 * half], [ROWS, half]),
            replica_id: ReplicaId::MAIN,
        };
        let mut buf = vec![0xa5u8; (ROWS * half * dtype.size()) as usize];
        let mut req = LoadRequest::new();
        req.tensors.push(TensorRequest { tensor, data: &mut buf, allow_shape_mismatch: false, allow_dtype_cast: cast });
        Engine::new(Arc::new(c)).load(store, &mut req, &LoadOptions::default()).map(|_| buf)
    })
    .expect("threads")
}

/// What rank `r`'s columns hold cast to `dtype`.
fn expected(r: usize, dtype: DType) -> Vec<u8> {
    let all = elements();
    let half = (COLS / 2) as usize;
    let cols: Vec<f32> =
        (0..ROWS as usize).flat_map(|row| all[row * COLS as usize + r * half..][..half].to_vec()).collect();
    let mut out = vec![0u8; cols.len() * dtype.size() as usize];
    cast_into(DType::F32, dtype, &bytes_of(&cols), &mut out);
    out
}

#[test]
fn a_load_that_allows_it_casts_each_element_as_pytorch_does() {
    let store = saved();
    for dtype in [DType::Bf16, DType::F16, DType::F64, DType::F32] {
        for (r, got) in load_columns(store.as_ref(), dtype, true).into_iter().enumerate() {
            let got = got.unwrap_or_else(|e| panic!("rank {r}, {dtype}: {e}"));
            assert_eq!(got, expected(r, dtype), "rank {r}, {dtype}");
        }
    }
    // bf16 of 1 + 2^-8 is a tie, to even: 1.0; 65520 is infinity in half; 1e-40 is zero there.
    let bf16 = load_columns(store.as_ref(), DType::Bf16, true).remove(0).unwrap();
    assert_eq!(u16::from_le_bytes([bf16[0], bf16[1]]), 0x3f80);
    let f16 = load_columns(store.as_ref(), DType::F16, true).remove(0).unwrap();
    assert_eq!(u16::from_le_bytes([f16[2], f16[3]]), 0x7c00);
}

#[test]
fn a_load_that_does_not_allow_it_or_of_integers_is_refused_naming_both_dtypes() {
    let store = saved();
    for r in load_columns(store.as_ref(), DType::Bf16, false) {
        let err = r.expect_err("a cast nobody allowed").to_string();
        assert!(err.contains("\"w\"") && err.contains("stored as f32, requested as bf16; allow a dtype cast"), "{err}");
    }
    for r in load_columns(store.as_ref(), DType::I32, true) {
        let err = r.expect_err("no cast to integers").to_string();
        assert!(err.contains("stored as f32, requested as i32") && !err.contains("allow"), "{err}");
    }
}
