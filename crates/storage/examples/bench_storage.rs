//! Runs the storage benchmark and prints its JSON report:
//! `cargo run --release -p dckpt-storage --example bench_storage -- DIR BYTES [RUNS] [s3://bucket/prefix S3_BYTES]`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args.first().ok_or("usage: bench_storage DIR BYTES [RUNS] [S3_URL]")?;
    let bytes: u64 = args.get(1).ok_or("missing BYTES")?.parse()?;
    let runs: usize = args.get(2).map(|r| r.parse()).transpose()?.unwrap_or(3);
    let local = dckpt_storage::bench::bench_local(std::path::Path::new(dir), bytes, runs)?;
    println!("{}", serde_json::to_string_pretty(&local)?);
    if let Some(url) = args.get(3) {
        let s3_bytes: u64 = args.get(4).map(|b| b.parse()).transpose()?.unwrap_or(bytes);
        let s3 = dckpt_storage::bench::bench_s3(url, s3_bytes, runs)?;
        println!("{}", serde_json::to_string_pretty(&s3)?);
    }
    Ok(())
}
