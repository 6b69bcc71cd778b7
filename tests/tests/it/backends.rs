//! A handful of cross-layout pairs on local disk and on the S3 test server.

use std::sync::Arc;

use dckpt_layout::{ModelSpec, OptimizerMode::*};
use dckpt_storage::{S3Config, S3Storage, Storage};
use dckpt_tests::{Setup, reshard};

fn pairs() -> [(Setup, Setup); 3] {
    [
        (Setup::new(8, 2, 2, 1, 2, 2, Layerwise), Setup::new(4, 1, 1, 1, 4, 1, Distributed)),
        (Setup::new(4, 1, 1, 2, 1, 1, Distributed), Setup::new(2, 2, 1, 1, 1, 1, Adam)),
        (Setup::new(4, 1, 1, 1, 1, 4, Adam), Setup::new(1, 1, 1, 1, 1, 1, None)),
    ]
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

#[test]
fn local_disk_pairs() {
    let spec = ModelSpec { vocab_size: 1100, ..ModelSpec::preset("tiny").unwrap() };
    for (i, (from, to)) in pairs().into_iter().enumerate() {
        let dir = std::env::temp_dir().join(unique(&format!("dckpt-local-{i}")));
        let store: Arc<dyn Storage> = dckpt_storage::open(dir.to_str().unwrap()).unwrap();
        assert!(reshard(&store, &spec, from, to, i as u64) > 0);
        let files = std::fs::read_dir(&dir).unwrap().count();
        assert!(files >= 2, "metadata and data files on disk");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

fn s3_url() -> String {
    let Ok(url) = std::env::var("DCKPT_TEST_S3_URL") else {
        panic!("DCKPT_TEST_S3_URL is not set: run the suite with `cargo xtask test`, which starts a local S3 server")
    };
    url
}

#[test]
fn s3_pairs() {
    let url = s3_url();
    let spec = ModelSpec::preset("tiny").unwrap();
    for (i, (from, to)) in pairs().into_iter().enumerate() {
        let store: Arc<dyn Storage> =
            dckpt_storage::open(&format!("{}/{}", url.trim_end_matches('/'), unique("engine"))).unwrap();
        assert!(reshard(&store, &spec, from, to, i as u64) > 0);
        assert!(store.list("").unwrap().len() >= 2);
    }
}

/// On S3 a rank spreads its pieces over data files of at most one PUT (`put_bytes_max`):
/// here about 30 MiB per rank in files of at most 5 MiB (a larger piece in a file of its own,
/// a multipart upload), saved at tp 2 and loaded at tp 1, every element checked.
#[test]
fn s3_ranks_write_several_files_of_one_put() {
    let max = 5u64 << 20;
    let config = S3Config { part_bytes: max as usize, put_bytes_max: max as usize, ..Default::default() };
    let url = format!("{}/{}", s3_url().trim_end_matches('/'), unique("files"));
    let store: Arc<dyn Storage> = Arc::new(S3Storage::from_url(&url, config).unwrap());
    let spec = ModelSpec {
        vocab_size: 4096,
        hidden_size: 256,
        num_attention_heads: 4,
        ffn_hidden_size: 1024,
        num_layers: 2,
        num_experts: 0,
        moe_ffn_hidden_size: Option::None,
        ..ModelSpec::preset("tiny").unwrap()
    };
    let (from, to) = (Setup::new(2, 2, 1, 1, 1, 1, Adam), Setup::new(1, 1, 1, 1, 1, 1, Adam));
    assert!(reshard(&store, &spec, from, to, 7) > 0);
    let meta = dckpt_engine::read_metadata_local(store.as_ref()).unwrap();
    assert!(meta.files.len() >= 8, "{} files for 2 ranks", meta.files.len());
    let within = meta.files.iter().filter(|f| f.bytes <= max).count();
    assert!(within + 2 >= meta.files.len(), "files over {max} bytes: {:?}", meta.files);
    assert_eq!(store.list("").unwrap().len(), meta.files.len() + 1, "the metadata and exactly its files");
}

/// Each rank's requests of a small save and load on S3, counted by kind on its own
/// [`Counting`], and the HTTP requests the store sent: a save writes one data file per rank
/// (one PUT each), plus the coordinator's check of the target and its commit; a load sends
/// no HEAD of a data file (the metadata gives their sizes) and one GET for each file a rank
/// reads; no rank lists anything.
#[test]
fn s3_requests_of_a_small_save_and_load() {
    use dckpt_collective::{CollectiveOptions, ThreadGroup};
    use dckpt_engine::{Engine, LoadOptions, LoadRequest, SaveOptions, SaveState, TensorRequest};
    use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
    use dckpt_storage::{Counting, RequestCounts};

    let (world, meta_name) = (4usize, "dckpt.meta");
    let url = format!("{}/{}", s3_url().trim_end_matches('/'), unique("requests"));
    let s3 = Arc::new(S3Storage::from_url(&url, S3Config::default()).unwrap());
    let store: Arc<dyn Storage> = s3.clone();
    // Rank r's rows of a row-split weight (its own file), and a norm every rank holds.
    let pieces = |r: usize| {
        let w = ShardedTensor {
            key: "w".into(),
            dtype: DType::U8,
            global_shape: [world as u64 * 4, 256].into(),
            region: Region::boxed([r as u64 * 4, 0], [4, 256]),
            replica_id: ReplicaId::MAIN,
        };
        let norm = ShardedTensor {
            replica_id: ReplicaId { dp: r as u32, ..ReplicaId::MAIN },
            ..ShardedTensor::whole("norm", DType::U8, [64])
        };
        vec![(w, (0..1024u32).map(|i| i as u8 ^ r as u8).collect::<Vec<u8>>()), (norm, (0..64).collect())]
    };
    let counts = ThreadGroup::run(world, &CollectiveOptions::default(), |r, c| {
        let engine = Engine::new(Arc::new(c));
        // Two counters in a row: the inner one sees the metadata's calls, the outer the data's.
        let meta = Arc::new(Counting::only(store.clone(), move |p| p == meta_name));
        let data = Counting::only(meta.clone(), move |p| p != meta_name);
        let p = pieces(r);
        let mut state = SaveState::new();
        for (t, d) in &p {
            state.push_tensor(t.clone(), d);
        }
        engine.save(&data, &state, &SaveOptions::default()).expect("save");
        let saved = (data.counts(), meta.counts());
        let mut bufs: Vec<Vec<u8>> = p.iter().map(|(_, d)| vec![0; d.len()]).collect();
        let mut req = LoadRequest::default();
        for ((t, _), b) in p.iter().zip(bufs.iter_mut()) {
            req.tensors.push(TensorRequest {
                tensor: t.clone(),
                data: b,
                allow_shape_mismatch: false,
                allow_dtype_cast: false,
            });
        }
        // Each rank reads what it needs itself: the fan-out's requests are counted in the
        // engine's `requests` test.
        engine.load(&data, &mut req, &LoadOptions { fan_out: false, ..LoadOptions::default() }).expect("load");
        assert_eq!(bufs[0], p[0].1, "rank {r}: loaded other bytes");
        (saved, (data.counts().since(&saved.0), meta.counts().since(&saved.1)))
    })
    .unwrap();
    let http = s3.requests();
    // Per rank: (saved, loaded), each (data, metadata).
    type Phases = ((RequestCounts, RequestCounts), (RequestCounts, RequestCounts));
    let sum = |f: fn(&Phases) -> u64| counts.iter().map(f).sum::<u64>();
    // Every HEAD was of the metadata or of the data files the coordinator looks at before
    // it commits (that every rank saved to one store), and every ranged read of a data file
    // one GET.
    assert_eq!(http.heads, sum(|c| c.0.0.sizes + c.0.1.sizes + c.1.1.sizes), "{http:?}");
    assert_eq!(http.gets, sum(|c| c.1.0.ranged_reads + c.0.1.gets + c.1.1.gets), "{http:?}");
    assert_eq!((http.puts, http.multipart, http.lists), (world as u64 + 1, 0, 0), "{http:?}");
    for (r, ((saved, _), (load, _))) in counts.iter().enumerate() {
        let ctx = format!("rank {r}: saved {saved:?}, loaded {load:?}");
        let looked_at = if r == 0 { (world as u64 - 1).min(3) } else { 0 };
        assert_eq!(
            (saved.writes(), saved.sizes, saved.lists, saved.gets, saved.ranged_reads),
            (1, looked_at, 0, 0, 0),
            "{ctx}"
        );
        assert_eq!((load.sizes, load.lists, load.gets, load.writes()), (0, 0, 0, 0), "{ctx}");
        // Its own file, and the coordinator's, which holds the norm's main copy.
        assert_eq!(load.ranged_reads, if r == 0 { 1 } else { 2 }, "{ctx}");
        assert_eq!(load.requests(), load.ranged_reads, "{ctx}");
    }
}
