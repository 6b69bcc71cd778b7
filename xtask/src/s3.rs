//! The local S3-compatible test server (moto). Owned by the storage work.
//!
//! `ensure_server` uses `DCKPT_TEST_S3_URL` as it is when set. Otherwise it installs moto into a
//! venv under `target/moto-venv` (once; later runs reuse it), starts `moto_server` on a free
//! loopback port, waits until it answers, creates the test bucket with a plain HTTP PUT, and
//! hands the test command the variables that point at it. The server stops when the returned
//! [`Server`] is dropped.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

/// The pinned server package; `server` brings the Flask front end `moto_server` needs.
const MOTO: &str = "moto[s3,server]==5.2.5";
const BUCKET: &str = "dckpt-test";
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A running (or externally provided) S3 server; stops the server on drop if we started it.
#[derive(Debug)]
pub struct Server {
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl Server {
    pub fn apply_env(&self, cmd: &mut Command) {
        if self.child.is_some() {
            // Credentials of a real account must not leak into requests to the test server.
            for k in ["AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"] {
                cmd.env_remove(k);
            }
        }
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn ensure_server() -> Result<Server> {
    if let Some(url) = std::env::var("DCKPT_TEST_S3_URL").ok().filter(|u| !u.is_empty()) {
        eprintln!("xtask: using the S3 server at DCKPT_TEST_S3_URL={url}");
        return Ok(Server { env: Vec::new(), child: None });
    }
    let venv = workspace_root().join("target").join("moto-venv");
    let moto_server = install(&venv)?;
    let port = free_port()?;
    let log_path = venv.join("moto-server.log");
    let log = File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let child = Command::new(&moto_server)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", moto_server.display()))?;
    let mut server = Server { env: Vec::new(), child: Some(child) };
    wait_until_up(&mut server, port, &log_path)?;
    let status = http(port, "PUT", &format!("/{BUCKET}"))?;
    if status != 200 {
        bail!("creating bucket {BUCKET} on 127.0.0.1:{port} answered HTTP {status}");
    }
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let endpoint = format!("http://127.0.0.1:{port}");
    eprintln!("xtask: moto S3 server at {endpoint} (log: {})", log_path.display());
    server.env = [
        ("DCKPT_TEST_S3_URL", format!("s3://{BUCKET}/run-{}-{nanos}", std::process::id())),
        ("AWS_ENDPOINT_URL", endpoint),
        ("AWS_ACCESS_KEY_ID", "testing".to_string()),
        ("AWS_SECRET_ACCESS_KEY", "testing".to_string()),
        ("AWS_REGION", "us-east-1".to_string()),
        ("AWS_ALLOW_HTTP", "true".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    Ok(server)
}

fn workspace_root() -> PathBuf {
    let xtask = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().unwrap_or(xtask).to_path_buf()
}

/// Creates the venv and installs moto unless `moto_server` is already there.
fn install(venv: &Path) -> Result<PathBuf> {
    let moto_server = venv.join("bin").join("moto_server");
    if moto_server.exists() {
        return Ok(moto_server);
    }
    eprintln!("xtask: installing {MOTO} into {}", venv.display());
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    run(Command::new(&python).arg("-m").arg("venv").arg(venv))
        .with_context(|| format!("creating a Python venv with `{python} -m venv` (is python3-venv installed?)"))?;
    let pip = venv.join("bin").join("pip");
    run(Command::new(&pip).args(["install", "--quiet", "--disable-pip-version-check", MOTO]))
        .with_context(|| format!("installing {MOTO} from PyPI"))?;
    if !moto_server.exists() {
        bail!("{MOTO} installed but {} is missing", moto_server.display());
    }
    Ok(moto_server)
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

fn wait_until_up(server: &mut Server, port: u16, log: &Path) -> Result<()> {
    let start = Instant::now();
    loop {
        if http(port, "GET", "/").is_ok() {
            return Ok(());
        }
        if let Some(child) = server.child.as_mut()
            && let Some(status) = child.try_wait()?
        {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            bail!("moto_server exited ({status}) before answering; its log:\n{text}");
        }
        if start.elapsed() > START_TIMEOUT {
            bail!("moto_server did not answer on 127.0.0.1:{port} within {START_TIMEOUT:?}; log at {}", log.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One bodiless HTTP/1.1 request to the loopback server; returns the status code.
fn http(port: u16, method: &str, path: &str) -> Result<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let req =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes())?;
    let mut reply = Vec::new();
    s.read_to_end(&mut reply)?;
    let text = String::from_utf8_lossy(&reply);
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok());
    status.with_context(|| format!("no HTTP status in reply to {method} {path}: {:?}", text.lines().next()))
}
