//! The coordinator pattern every phase uses: each rank sends its status to rank 0, rank 0
//! decides, every rank learns the decision. A rank that failed locally still takes part,
//! so its peers hear of the failure (with its rank and cause) instead of hanging.

use dckpt_collective::Collective;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Error;
use crate::error::first_failure;

/// The coordinator of every protocol.
pub const COORDINATOR: usize = 0;

/// Which call of the engine a rank is in. Its first round carries it, so that ranks making
/// different calls (one saving while another loads) fail at once, naming both: they waited
/// in different collectives until the timeout (ten minutes on gloo), which named no cause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum Call {
    Save = 1,
    Load = 2,
}

impl Call {
    /// The two words a first round's all-reduce (minimum) carries after two of the call's
    /// own (four in all, whatever the call): the call, and its complement, whose minimum
    /// gives the largest call of any rank.
    pub fn words(self) -> [u64; 2] {
        [self as u64, u64::MAX - self as u64]
    }

    /// Fails where the reduced `words` show ranks in different calls.
    pub fn check(words: &[u64]) -> Result<(), Error> {
        let (least, most) = (words[0], u64::MAX - words[1]);
        let name = |c: u64| match c {
            1 => "save",
            2 => "load",
            _ => "another call",
        };
        match least == most {
            true => Ok(()),
            false => Err(Error::usage(format!(
                "the ranks make different calls: some {}, some {}; every rank must make the same calls in the same order",
                name(least),
                name(most)
            ))),
        }
    }
}

pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    rmp_serde::to_vec(v).expect("protocol messages serialize")
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, Error> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::protocol(format!("undecodable {what}: {e}")))
}

/// Gathers every rank's `local` on the coordinator, lets it `decide`, and broadcasts the
/// decision. `decide` runs on the coordinator only, with the messages in rank order. The
/// coordinator keeps its own message and its decision as values: it neither encodes nor
/// decodes what it already holds. A message the coordinator cannot decode (ranks running
/// different versions) fails every rank at once, with the coordinator's reason.
pub fn gather_decide<L, D>(
    coll: &dyn Collective,
    local: L,
    what: &str,
    decide: impl FnOnce(Vec<L>) -> D,
) -> Result<D, Error>
where
    L: Serialize + DeserializeOwned,
    D: Serialize + DeserializeOwned,
{
    match gather_locals(coll, local, what)? {
        Some(Ok(locals)) => {
            let decision = told_if_panics(
                what,
                || decide(locals),
                |e| {
                    let _ = coll.broadcast(COORDINATOR, Some(&encode(&Err::<(), &Error>(e))));
                },
            );
            coll.broadcast(COORDINATOR, Some(&encode(&Ok::<&D, &str>(&decision)))).map_err(in_phase(what))?;
            Ok(decision)
        }
        Some(Err(e)) => {
            coll.broadcast(COORDINATOR, Some(&encode(&Err::<(), &Error>(&e)))).map_err(in_phase(what))?;
            Err(e)
        }
        None => unwrap_decision(&coll.broadcast(COORDINATOR, None).map_err(in_phase(what))?, what),
    }
}

/// Like [`gather_decide`], but the decision holds one value per rank (`decide` returns them
/// in rank order) and each rank receives only its own, by a scatter: for decisions that grow
/// with the world, such as which chunks each rank writes. At 16,384 ranks a broadcast would
/// send every rank everyone's part.
pub fn gather_decide_each<L, D>(
    coll: &dyn Collective,
    local: L,
    what: &str,
    decide: impl FnOnce(Vec<L>) -> Vec<D>,
) -> Result<D, Error>
where
    L: Serialize + DeserializeOwned,
    D: Serialize + DeserializeOwned,
{
    gather_decide_each_sized(coll, local, what, decide).map(|(d, _)| d)
}

/// [`gather_decide_each`], also returning the bytes of this rank's part as it received it
/// (none on the coordinator, which keeps its part as a value).
pub fn gather_decide_each_sized<L, D>(
    coll: &dyn Collective,
    local: L,
    what: &str,
    decide: impl FnOnce(Vec<L>) -> Vec<D>,
) -> Result<(D, u64), Error>
where
    L: Serialize + DeserializeOwned,
    D: Serialize + DeserializeOwned,
{
    match gather_locals(coll, local, what)? {
        Some(Ok(locals)) => {
            let mut decisions = told_if_panics(
                what,
                || decide(locals),
                |e| {
                    let _ = coll.scatter(COORDINATOR, Some(vec![encode(&Err::<(), &Error>(e)); coll.world_size()]));
                },
            );
            let parts: Vec<Vec<u8>> = decisions
                .iter()
                .enumerate()
                .map(|(r, d)| if r == COORDINATOR { Vec::new() } else { encode(&Ok::<&D, &str>(d)) })
                .collect();
            // The collective refuses a set of the wrong size (and aborts the others).
            coll.scatter(COORDINATOR, Some(parts)).map_err(in_phase(what))?;
            Ok((decisions.swap_remove(COORDINATOR), 0))
        }
        Some(Err(e)) => {
            let part = encode(&Err::<(), &Error>(&e));
            coll.scatter(COORDINATOR, Some(vec![part; coll.world_size()])).map_err(in_phase(what))?;
            Err(e)
        }
        None => {
            let part = coll.scatter(COORDINATOR, None).map_err(in_phase(what))?;
            unwrap_decision(&part, what).map(|d| (d, part.len() as u64))
        }
    }
}

/// `decide`'s value on the coordinator. Should it panic (a bug, or a host's storage
/// wrapper that panics), the other ranks, waiting for the decision, are `tell`-ed an error
/// naming the coordinator rather than left until the collective's timeout, and the panic
/// goes on here.
fn told_if_panics<D>(what: &str, decide: impl FnOnce() -> D, tell: impl FnOnce(&Error)) -> D {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(decide)).unwrap_or_else(|panic| {
        let text = crate::error::panic_text(panic.as_ref());
        tell(
            &Error::internal(format!("the coordinator panicked deciding the {what}: {text}"))
                .on_rank(COORDINATOR as u32),
        );
        std::panic::resume_unwind(panic)
    })
}

/// One failure as every rank's part of a decision: the coordinator's own value, a copy
/// for each of the others.
pub fn for_every_rank<D>(e: Error, world: usize) -> Vec<Result<D, Error>> {
    let mut each: Vec<Result<D, Error>> = (1..world).map(|_| Err(e.replicate())).collect();
    each.insert(COORDINATOR, Err(e));
    each
}

/// Every rank's `local` on the coordinator (`Some`, rank order; its own kept as a value,
/// or the first message it could not decode), `None` elsewhere.
fn gather_locals<L>(coll: &dyn Collective, local: L, what: &str) -> Result<Option<Result<Vec<L>, Error>>, Error>
where
    L: Serialize + DeserializeOwned,
{
    let root = coll.rank() == COORDINATOR;
    let sent = coll.gather(COORDINATOR, if root { Vec::new() } else { encode(&local) });
    let Some(msgs) = sent.map_err(in_phase(what))? else {
        return Ok(None);
    };
    let mut own = Some(local);
    let locals = msgs
        .iter()
        .enumerate()
        .map(|(r, m)| match own.take_if(|_| r == COORDINATOR) {
            Some(l) => Ok(l),
            None => decode::<L>(m, &format!("{what} from rank {r}")),
        })
        .collect::<Result<Vec<L>, Error>>();
    Ok(Some(locals))
}

/// A decision as the coordinator sent it: the value, or why it could not decide (the same
/// error the coordinator returns).
fn unwrap_decision<D: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<D, Error> {
    decode::<Result<D, Error>>(bytes, what)?
}

/// A collective failure with the phase it stopped in (`what`), so that every rank's error
/// says where the job stopped, not only which call (a stalled rank is named with the phase
/// the others waited for it in).
pub fn in_phase(what: &str) -> impl Fn(dckpt_collective::Error) -> Error + '_ {
    move |e| Error::from(e.in_phase(what))
}

/// Makes every rank return the same result: the first failing rank's error (as the same
/// typed value, with that rank), or `Ok`.
pub fn agree(coll: &dyn Collective, local: Result<(), Error>, what: &str) -> Result<(), Error> {
    let verdict: Result<(), Error> = gather_decide(coll, local, what, |all| first_failure(all).map(drop))?;
    verdict
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use dckpt_collective::{CollectiveOptions, ThreadGroup};

    use super::*;
    use crate::ErrorKind;

    /// A rank that sends a message of another shape (another version of dckpt) fails every
    /// rank at once with the coordinator's reason, instead of leaving the others waiting for
    /// a decision until the collective's timeout.
    #[test]
    fn an_undecodable_message_fails_every_rank_at_once() {
        let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
        let started = Instant::now();
        let results = ThreadGroup::run(3, &opts, |r, c| {
            let broadcast: Result<u64, Error> = if r == 2 {
                gather_decide(&c, "not a number".to_string(), "test", |_| String::new()).map(|_| 0)
            } else {
                gather_decide(&c, r as u64, "test", |all: Vec<u64>| all.iter().sum::<u64>())
            };
            let scattered: Result<u64, Error> = if r == 1 {
                gather_decide_each(&c, vec![1u8], "test each", |_| vec![String::new(); 3]).map(|_| 0)
            } else {
                gather_decide_each(&c, r as u64, "test each", |all: Vec<u64>| all)
            };
            (broadcast, scattered)
        })
        .expect("threads");
        assert!(started.elapsed() < Duration::from_secs(10), "ranks waited for the timeout");
        for (r, (b, s)) in results.into_iter().enumerate() {
            for (what, res, culprit) in [("broadcast", b, "rank 2"), ("scatter", s, "rank 1")] {
                match res.as_ref().map_err(Error::kind) {
                    Err(ErrorKind::Protocol { detail }) => {
                        assert!(detail.contains(culprit), "rank {r}, {what}: {detail}");
                    }
                    other => panic!("rank {r}, {what}: expected a protocol error, got {other:?}"),
                }
            }
        }
    }

    /// A decision that panics on the coordinator (a bug, or a host's storage wrapper) fails
    /// the other ranks at once with its message, for a broadcast and a scatter alike; they
    /// waited for the collective's timeout, as the coordinator's collective outlives the
    /// panic where a background save catches it.
    #[test]
    fn a_panicking_decision_fails_the_other_ranks_at_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let opts = CollectiveOptions { timeout: Duration::from_secs(60), ..CollectiveOptions::default() };
        let heard = AtomicUsize::new(0);
        let results = ThreadGroup::run(3, &opts, |r, c| {
            let started = Instant::now();
            let mut out = Vec::new();
            for each in [false, true] {
                let call = || match each {
                    false => gather_decide(&c, r as u64, "test", |_: Vec<u64>| -> u64 { panic!("boom") }),
                    true => gather_decide_each(&c, r as u64, "test each", |_: Vec<u64>| -> Vec<u64> { panic!("boom") }),
                };
                match r {
                    0 => assert!(
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)).is_err(),
                        "the panic goes on"
                    ),
                    _ => {
                        out.push((call().map_err(|e| e.to_string()), started.elapsed()));
                        heard.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            // The coordinator keeps its collective, as an engine does after a caught panic.
            while r == 0 && heard.load(Ordering::SeqCst) < 4 && started.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(10));
            }
            out
        })
        .expect("threads");
        for (r, outs) in results.into_iter().enumerate().skip(1) {
            assert_eq!(outs.len(), 2);
            for (res, took) in outs {
                let e = res.expect_err("the decision failed");
                assert!(took < Duration::from_secs(10), "rank {r} waited {took:?}: {e}");
                assert!(e.contains("panicked") && e.contains("boom") && e.contains("rank 0"), "rank {r}: {e}");
            }
        }
    }
}
