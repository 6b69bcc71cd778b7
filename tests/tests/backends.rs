//! A handful of cross-layout pairs on local disk and on the S3 test server.

use std::sync::Arc;

use dckpt_layout::{ModelSpec, OptimizerMode::*};
use dckpt_storage::Storage;
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

#[test]
fn s3_pairs() {
    let Ok(url) = std::env::var("DCKPT_TEST_S3_URL") else {
        panic!("DCKPT_TEST_S3_URL is not set: run the suite with `cargo xtask test`, which starts a local S3 server")
    };
    let spec = ModelSpec::preset("tiny").unwrap();
    for (i, (from, to)) in pairs().into_iter().enumerate() {
        let store: Arc<dyn Storage> =
            dckpt_storage::open(&format!("{}/{}", url.trim_end_matches('/'), unique("engine"))).unwrap();
        assert!(reshard(&store, &spec, from, to, i as u64) > 0);
        assert!(store.list("").unwrap().len() >= 2);
    }
}
