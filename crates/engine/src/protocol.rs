//! The coordinator pattern every phase uses: each rank sends its status to rank 0, rank 0
//! decides, every rank learns the decision. A rank that failed locally still takes part,
//! so its peers hear of the failure (with its rank and cause) instead of hanging.

use dckpt_collective::Collective;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Error;

/// The coordinator of every protocol.
pub const COORDINATOR: usize = 0;

pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    rmp_serde::to_vec(v).expect("protocol messages serialize")
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, Error> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::Protocol { detail: format!("undecodable {what}: {e}") })
}

/// Gathers every rank's `local` on the coordinator, lets it `decide`, and broadcasts the
/// decision. `decide` runs on the coordinator only, with the messages in rank order. The
/// coordinator keeps its own message and its decision as values: it neither encodes nor
/// decodes what it already holds.
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
    let root = coll.rank() == COORDINATOR;
    let gathered = coll.gather(COORDINATOR, if root { Vec::new() } else { encode(&local) })?;
    match gathered {
        Some(msgs) => {
            let mut own = Some(local);
            let locals = msgs
                .iter()
                .enumerate()
                .map(|(r, m)| match own.take_if(|_| r == COORDINATOR) {
                    Some(l) => Ok(l),
                    None => decode::<L>(m, what),
                })
                .collect::<Result<Vec<L>, Error>>()?;
            let decision = decide(locals);
            coll.broadcast(COORDINATOR, Some(&encode(&decision)))?;
            Ok(decision)
        }
        None => decode(&coll.broadcast(COORDINATOR, None)?, what),
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
    let root = coll.rank() == COORDINATOR;
    let gathered = coll.gather(COORDINATOR, if root { Vec::new() } else { encode(&local) })?;
    match gathered {
        Some(msgs) => {
            let mut own = Some(local);
            let locals = msgs
                .iter()
                .enumerate()
                .map(|(r, m)| match own.take_if(|_| r == COORDINATOR) {
                    Some(l) => Ok(l),
                    None => decode::<L>(m, what),
                })
                .collect::<Result<Vec<L>, Error>>()?;
            let mut decisions = decide(locals);
            let parts: Vec<Vec<u8>> = decisions
                .iter()
                .enumerate()
                .map(|(r, d)| if r == COORDINATOR { Vec::new() } else { encode(d) })
                .collect();
            // The collective refuses a set of the wrong size (and aborts the others).
            coll.scatter(COORDINATOR, Some(parts))?;
            Ok(decisions.swap_remove(COORDINATOR))
        }
        None => decode(&coll.scatter(COORDINATOR, None)?, what),
    }
}

/// Makes every rank return the same result: the first failing rank's error, or `Ok`.
pub fn agree(coll: &dyn Collective, local: Result<(), String>, what: &str) -> Result<(), Error> {
    let verdict: Result<(), (u32, String)> = gather_decide(coll, local, what, |all| {
        all.into_iter().enumerate().find_map(|(r, res)| res.err().map(|e| (r as u32, e))).map_or(Ok(()), Err)
    })?;
    verdict.map_err(|(rank, message)| Error::Rank { rank, message })
}
