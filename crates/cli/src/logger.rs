//! The CLI's subscriber for the libraries' `log` records: warnings and errors on stderr,
//! more with `DCKPT_LOG=info|debug|trace`. Libraries only emit records; the binary decides
//! where they go.

use log::{Level, LevelFilter, Log, Metadata, Record};

struct Stderr;

impl Log for Stderr {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &Record<'_>) {
        if self.enabled(r.metadata()) {
            let level = if r.level() <= Level::Warn { "" } else { r.level().as_str() };
            let sep = if level.is_empty() { "" } else { " " };
            eprintln!("dckpt: {level}{sep}{}", r.args());
        }
    }

    fn flush(&self) {}
}

/// Installs the subscriber once, at the start of `main`.
pub fn install() {
    let level = match std::env::var("DCKPT_LOG").as_deref() {
        Ok("off") => LevelFilter::Off,
        Ok("error") => LevelFilter::Error,
        Ok("info") => LevelFilter::Info,
        Ok("debug") => LevelFilter::Debug,
        Ok("trace") => LevelFilter::Trace,
        _ => LevelFilter::Warn,
    };
    if log::set_logger(&Stderr).is_ok() {
        log::set_max_level(level);
    }
}
