//! Parallel configuration and rank <-> coordinates.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::LayoutError;

/// Sizes of the parallel dimensions. Data-parallel sizes follow from the world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    /// Tensor-parallel size: non-expert weights are split over this many ranks.
    pub tp: u32,
    /// Pipeline-parallel size: the layers are divided evenly over this many stages.
    pub pp: u32,
    /// Context-parallel size: ranks that split the sequence and hold the same weights.
    pub cp: u32,
    /// Expert-parallel size: the experts of a MoE layer are divided over this many ranks.
    pub ep: u32,
    /// Expert tensor-parallel size: each expert's weights are split over this many ranks.
    pub etp: u32,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig { tp: 1, pp: 1, cp: 1, ep: 1, etp: 1 }
    }
}

/// A parallel dimension, as named in a rank order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dim {
    /// Tensor parallel; expert tensor parallel (etp) in the expert view.
    Tp,
    /// Context parallel; size 1 in the expert view.
    Cp,
    /// Expert parallel; size 1 in the dense view.
    Ep,
    /// Data parallel; expert data parallel (edp) in the expert view.
    Dp,
    /// Pipeline parallel, the same in both views.
    Pp,
}

impl Dim {
    const ALL: [Dim; 5] = [Dim::Tp, Dim::Cp, Dim::Ep, Dim::Dp, Dim::Pp];

    fn name(self) -> &'static str {
        match self {
            Dim::Tp => "tp",
            Dim::Cp => "cp",
            Dim::Ep => "ep",
            Dim::Dp => "dp",
            Dim::Pp => "pp",
        }
    }
}

/// The order in which parallel dimensions vary along global ranks, fastest first.
///
/// Megatron's default is `tp-cp-ep-dp-pp`. The dense view uses it with `ep = 1`; the expert
/// view uses it with `tp = etp`, `cp = 1`, `dp = expert-dp` (so `etp-ep-edp-pp` by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankOrder(pub [Dim; 5]);

impl Default for RankOrder {
    fn default() -> Self {
        RankOrder([Dim::Tp, Dim::Cp, Dim::Ep, Dim::Dp, Dim::Pp])
    }
}

impl RankOrder {
    fn position(&self, d: Dim) -> usize {
        self.0.iter().position(|&x| x == d).unwrap_or(0)
    }
}

impl fmt::Display for RankOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|d| d.name()).collect();
        f.write_str(&names.join("-"))
    }
}

impl FromStr for RankOrder {
    type Err = LayoutError;

    /// Parses `tp-cp-ep-dp-pp` style orders: each of tp, cp, ep, dp, pp exactly once.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || LayoutError::BadOrder { order: s.to_string() };
        let parts: Vec<&str> = s.split('-').collect();
        if parts.len() != 5 {
            return Err(bad());
        }
        let mut dims = [Dim::Tp; 5];
        for (slot, p) in dims.iter_mut().zip(&parts) {
            *slot = *Dim::ALL.iter().find(|d| d.name() == p.to_ascii_lowercase()).ok_or_else(bad)?;
        }
        if Dim::ALL.iter().any(|d| !dims.contains(d)) {
            return Err(bad());
        }
        Ok(RankOrder(dims))
    }
}

/// A rank's place in the dense (non-expert) view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DenseCoord {
    /// Tensor-parallel rank: which TP chunk of non-expert weights it holds.
    pub tp: u32,
    /// Context-parallel rank.
    pub cp: u32,
    /// Data-parallel rank: which replica of the model it belongs to.
    pub dp: u32,
    /// Pipeline stage.
    pub pp: u32,
}

/// A rank's place in the expert view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExpertCoord {
    /// Expert tensor-parallel rank: which chunk of each local expert's weights it holds.
    pub etp: u32,
    /// Expert-parallel rank: which range of the experts it holds.
    pub ep: u32,
    /// Expert data-parallel rank: which replica of its experts it holds.
    pub edp: u32,
    /// Pipeline stage, the same as in the dense view.
    pub pp: u32,
}

/// A parallel configuration placed on a world of ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The parallel sizes.
    pub config: ParallelConfig,
    /// The number of ranks.
    pub world_size: u32,
    /// Data-parallel size of the dense view: world / (tp * pp * cp).
    pub dp: u32,
    /// Data-parallel size of the expert view: world / (etp * ep * pp).
    pub expert_dp: u32,
    /// How the dimensions vary along global ranks.
    pub order: RankOrder,
}

impl Layout {
    /// Places `config` on `world_size` ranks in Megatron's default order.
    pub fn new(config: ParallelConfig, world_size: u32) -> Result<Layout, LayoutError> {
        Layout::with_order(config, world_size, RankOrder::default())
    }

    /// Places `config` on `world_size` ranks in `order`; fails on a zero size, a world
    /// not divisible by either view's product, or an order that gives a rank different
    /// pipeline stages in the two views.
    pub fn with_order(config: ParallelConfig, world_size: u32, order: RankOrder) -> Result<Layout, LayoutError> {
        let c = config;
        for (name, v) in [("world", world_size), ("tp", c.tp), ("pp", c.pp), ("cp", c.cp), ("ep", c.ep), ("etp", c.etp)]
        {
            if v == 0 {
                return Err(LayoutError::ZeroSize { name });
            }
        }
        // An order that is no permutation of the five dimensions gives two ranks one place
        // (both main for a chunk, another chunk without a main); only its parse checked it.
        if !Dim::ALL.iter().all(|d| order.0.contains(d)) {
            return Err(LayoutError::BadOrder { order: order.to_string() });
        }
        // In u128: three u32 sizes overflow u64 (and a chosen wrap was accepted).
        let dense = c.tp as u128 * c.pp as u128 * c.cp as u128;
        let dense = u64::try_from(dense).unwrap_or(u64::MAX);
        if !(world_size as u64).is_multiple_of(dense) {
            return Err(LayoutError::WorldNotDivisible { world: world_size, product: dense, what: "tp * pp * cp" });
        }
        let expert = u64::try_from(c.etp as u128 * c.ep as u128 * c.pp as u128).unwrap_or(u64::MAX);
        if !(world_size as u64).is_multiple_of(expert) {
            return Err(LayoutError::WorldNotDivisible { world: world_size, product: expert, what: "etp * ep * pp" });
        }
        let layout = Layout {
            config,
            world_size,
            dp: (world_size as u64 / dense) as u32,
            expert_dp: (world_size as u64 / expert) as u32,
            order,
        };
        // Both views must put a rank on the same pipeline stage.
        if c.pp > 1 && layout.stride(Dim::Pp, false) != layout.stride(Dim::Pp, true) {
            return Err(LayoutError::PipelineViewsDisagree { order: order.to_string() });
        }
        Ok(layout)
    }

    fn size(&self, d: Dim, expert: bool) -> u32 {
        let c = &self.config;
        match (d, expert) {
            (Dim::Tp, false) => c.tp,
            (Dim::Tp, true) => c.etp,
            (Dim::Cp, false) => c.cp,
            (Dim::Cp, true) => 1,
            (Dim::Ep, false) => 1,
            (Dim::Ep, true) => c.ep,
            (Dim::Dp, false) => self.dp,
            (Dim::Dp, true) => self.expert_dp,
            (Dim::Pp, _) => c.pp,
        }
    }

    /// Global-rank distance between neighbours along `d`.
    fn stride(&self, d: Dim, expert: bool) -> u64 {
        let pos = self.order.position(d);
        self.order.0[..pos].iter().map(|&x| self.size(x, expert) as u64).product()
    }

    fn coord(&self, rank: u32, d: Dim, expert: bool) -> u32 {
        ((rank as u64 / self.stride(d, expert)) % self.size(d, expert) as u64) as u32
    }

    /// The dense-view coordinates of global `rank`.
    pub fn dense_coord(&self, rank: u32) -> DenseCoord {
        DenseCoord {
            tp: self.coord(rank, Dim::Tp, false),
            cp: self.coord(rank, Dim::Cp, false),
            dp: self.coord(rank, Dim::Dp, false),
            pp: self.coord(rank, Dim::Pp, false),
        }
    }

    /// The expert-view coordinates of global `rank`.
    pub fn expert_coord(&self, rank: u32) -> ExpertCoord {
        ExpertCoord {
            etp: self.coord(rank, Dim::Tp, true),
            ep: self.coord(rank, Dim::Ep, true),
            edp: self.coord(rank, Dim::Dp, true),
            pp: self.coord(rank, Dim::Pp, true),
        }
    }

    /// The global rank at dense-view coordinates `c`; inverse of [`Layout::dense_coord`].
    pub fn dense_rank(&self, c: DenseCoord) -> u32 {
        let parts = [(Dim::Tp, c.tp), (Dim::Cp, c.cp), (Dim::Dp, c.dp), (Dim::Pp, c.pp)];
        parts.iter().map(|&(d, v)| v as u64 * self.stride(d, false)).sum::<u64>() as u32
    }

    /// The global rank at expert-view coordinates `c`; inverse of [`Layout::expert_coord`].
    pub fn expert_rank(&self, c: ExpertCoord) -> u32 {
        let parts = [(Dim::Tp, c.etp), (Dim::Ep, c.ep), (Dim::Dp, c.edp), (Dim::Pp, c.pp)];
        parts.iter().map(|&(d, v)| v as u64 * self.stride(d, true)).sum::<u64>() as u32
    }

    /// Size of the DP x CP group over which non-expert state is replicated and sharded.
    pub fn dp_cp_size(&self) -> u32 {
        self.dp * self.config.cp
    }

    /// A rank's index in its DP x CP group, members ordered by global rank.
    pub fn dp_cp_rank(&self, rank: u32) -> u32 {
        let c = self.dense_coord(rank);
        if self.order.position(Dim::Cp) < self.order.position(Dim::Dp) {
            c.dp * self.config.cp + c.cp
        } else {
            c.cp * self.dp + c.dp
        }
    }
}
