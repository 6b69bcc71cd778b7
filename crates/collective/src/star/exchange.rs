//! `exchange` on the star: direct sends between ranks, with a route round through the hub
//! where the link must learn where its peers are (TCP); the hub forwards no data.

use bytes::Bytes;

use super::{Call, HUB, Link, Star, State, check_len};
use crate::wire::{self, kind};
use crate::{Error, Result};

/// The largest route (an address, as text) the hub may answer with.
const ROUTE_BYTES_MAX: u64 = 1024;

impl<L: Link> Star<L> {
    /// Direct sends, then one receive per entry of `from`. Where the link must learn its
    /// peers' addresses (TCP), a route round first: each rank tells the hub which of its
    /// destinations it cannot reach yet and gets back how to; the hub forwards no data.
    pub(super) fn exchange_body(
        &self,
        st: &mut State<L>,
        sends: Vec<(usize, Bytes)>,
        from: &[usize],
        call: Call,
    ) -> Result<Vec<Bytes>> {
        for &(to, ref msg) in &sends {
            self.check_peer(to, "send to")?;
            self.check_own(msg.len())?;
        }
        for &r in from {
            self.check_peer(r, "receive from")?;
        }
        if L::ROUTED && self.world > 1 {
            let mut unreached: Vec<usize> =
                sends.iter().map(|(to, _)| *to).filter(|&to| st.link.needs_route(to)).collect();
            unreached.sort_unstable();
            unreached.dedup();
            self.route_round(st, &unreached, call)?;
        }
        for (to, msg) in sends {
            self.send(st, to, call, msg)?;
        }
        let got = self.collect(st, from, call)?;
        for (&r, m) in from.iter().zip(&got) {
            check_len(r, m.len() as u64, self.bytes_max())?;
        }
        Ok(got)
    }

    /// Every rank sends the hub the ranks it needs routes to (u64s, often none); the hub
    /// answers each with one route per rank asked, and every rank connects.
    fn route_round(&self, st: &mut State<L>, unreached: &[usize], call: Call) -> Result<()> {
        let call = Call { kind: kind::ROUTE, op: kind::name(kind::ROUTE), ..call };
        let asked: Vec<u64> = unreached.iter().map(|&r| r as u64).collect();
        let routes: Vec<Vec<u8>> = if self.rank == HUB {
            let mut asks = vec![asked];
            for (i, part) in self.collect(st, &self.peers(), call)?.iter().enumerate() {
                asks.push(wire::decode_u64s(part).map_err(|detail| Error::Protocol { rank: i + 1, detail })?);
            }
            let mut own = Vec::new();
            for (asker, ask) in asks.iter().enumerate() {
                let mut answer = Vec::with_capacity(ask.len());
                for &to in ask {
                    let to = usize::try_from(to)
                        .ok()
                        .filter(|&to| to < self.world && to != asker)
                        .ok_or_else(|| Error::Protocol { rank: asker, detail: format!("route asked to rank {to}") })?;
                    let route = st.link.route(asker, to).ok_or_else(|| Error::Protocol {
                        rank: to,
                        detail: "no address for this rank at the hub".into(),
                    })?;
                    answer.push(Bytes::from(route));
                }
                if asker == HUB {
                    own = answer.into_iter().map(|b| b.to_vec()).collect();
                } else {
                    self.send(st, asker, call, wire::encode_set(&answer))?;
                }
            }
            own
        } else {
            self.send(st, HUB, call, wire::encode_u64s(&asked))?;
            let set = self.collect(st, &[HUB], call)?.remove(0);
            wire::decode_set(&set, unreached.len(), ROUTE_BYTES_MAX)
                .map_err(|detail| Error::Protocol { rank: HUB, detail })?
        };
        for (&to, route) in unreached.iter().zip(&routes) {
            st.link.connect(to, route, call.deadline)?;
        }
        Ok(())
    }

    fn check_peer(&self, peer: usize, what: &str) -> Result<()> {
        if peer >= self.world || peer == self.rank {
            return Err(Error::invalid(format!(
                "exchange: rank {} cannot {what} rank {peer} (world of {})",
                self.rank, self.world
            )));
        }
        Ok(())
    }
}
