//! Key filters: `--include` and `--exclude` globs over the full key.

/// Whether `key` matches `pattern`: `*` is any run of characters (dots included, so
/// `optimizer.*` matches every key under `optimizer.`), `**` the same, `?` one character;
/// everything else matches itself.
pub fn glob_match(pattern: &str, key: &str) -> bool {
    let (p, k): (Vec<char>, Vec<char>) = (pattern.chars().collect(), key.chars().collect());
    let (mut pi, mut ki) = (0, 0);
    // Where the last `*` was, and how much of the key it had taken: a mismatch after it
    // lets it take one more character (linear backtracking, no recursion).
    let mut star: Option<(usize, usize)> = None;
    while ki < k.len() {
        if pi < p.len() && p[pi] == '*' {
            while pi < p.len() && p[pi] == '*' {
                pi += 1;
            }
            star = Some((pi, ki));
        } else if pi < p.len() && (p[pi] == '?' || p[pi] == k[ki]) {
            pi += 1;
            ki += 1;
        } else if let Some((sp, sk)) = star {
            pi = sp;
            ki = sk + 1;
            star = Some((sp, sk + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// Which keys to keep: those matching any include (all when there is none) and no
/// exclude; an exclude wins.
#[derive(Clone, Debug, Default)]
pub struct KeyFilter {
    /// Globs a kept key must match one of (none: every key).
    pub include: Vec<String>,
    /// Globs no kept key matches.
    pub exclude: Vec<String>,
}

impl KeyFilter {
    /// Whether `key` is kept.
    pub fn keeps(&self, key: &str) -> bool {
        (self.include.is_empty() || self.include.iter().any(|g| glob_match(g, key)))
            && !self.exclude.iter().any(|g| glob_match(g, key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_the_full_key() {
        assert!(glob_match("optimizer.*", "optimizer.state.fc1.weight.exp_avg"));
        assert!(!glob_match("optimizer.*", "model.optimizer.x"));
        assert!(glob_match("*.weight", "decoder.layers.0.fc1.weight"));
        assert!(!glob_match("*.weight", "decoder.layers.0.fc1.weight_scale"));
        assert!(glob_match("layers.?.fc", "layers.7.fc"));
        assert!(!glob_match("layers.?.fc", "layers.17.fc"));
        assert!(glob_match("**", ""));
        assert!(glob_match("a**b*c", "axxbyyc"));
        assert!(!glob_match("a*b*c", "axxbyy"));
        assert!(glob_match("exact", "exact"));
        assert!(!glob_match("exact", "exactly"));
    }

    #[test]
    fn an_exclude_wins_over_an_include() {
        let f = KeyFilter { include: vec!["model.*".into()], exclude: vec!["*.bias".into()] };
        assert!(f.keeps("model.fc.weight"));
        assert!(!f.keeps("model.fc.bias"));
        assert!(!f.keeps("optimizer.fc.weight"));
        assert!(KeyFilter::default().keeps("anything"));
    }
}
