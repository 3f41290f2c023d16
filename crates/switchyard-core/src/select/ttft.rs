//! The `ttft` policy: a cost in time, not in blocks.
//!
//! For a request of `P` prompt tokens and each worker `w` with `overlap[w]`
//! leading prompt blocks cached on its device and `host[w]` blocks right
//! after those in its host tier:
//!
//! ```text
//! cached[w]   = min(P, max(overlap[w], active[w])·block_size)
//!                                                          device hit, now or by the time
//!                                                          this prefill runs (fan-out)
//! restored[w] = min(P − cached[w], host[w]·block_size)     host hit: copied to the device, not computed
//! new[w]      = P − cached[w] − restored[w]                uncached tokens here
//! ahead[w]    = active_prefill_tokens[w] + active_requests[w]
//! held[w]     = min(1, active_decode_blocks[w] / kv_capacity_blocks[w])   (0 without a capacity)
//! step[w]     = decode_step_ms(w, held[w])  if the worker runs anything, else 0
//! wait[w]     = ½ · step[w]
//! first[w]    = wait[w] + prefill_ms(w, ahead[w] + new[w])  when its first token would come
//!             + restore_ms(w, restored[w])
//!             + adapter_load_ms[w]   (the request's LoRA adapter is not loaded there:
//!                                     its load time, or what is left of a load under way)
//! locality[w] = locality_weight · prefill_ms(w, P − max(cached[w], holds[w]·block_size) − restored[w])
//!                                                          what scattering the prefix costs later
//!               (holds: the device prefix blocks a hybrid worker holds,
//!               resumable or not; overlap[w] for any other worker)
//! usage[w]    = min(1, (active_decode_blocks[w] + prompt blocks not already active there) / kv_capacity_blocks[w])
//! pressure[w] = pressure_weight · usage[w]² · prefill_ms(w, P)
//! turnover[w] = turnover_weight · min(1, recent_writes[w] / kv_capacity_tokens[w]) · prefill_ms(w, new[w])
//! decode[w]   = decode_weight · decode_step_ms(w, usage[w])  the pace of its next tokens there
//! stall[w]    = interference_weight · active_requests[w]
//!               · max(0, prefill_ms(w, new[w] + active_requests[w]) − step[w])   (0 when new[w] = 0)
//! cost[w]     = first[w] + locality[w] + pressure[w] + turnover[w] + decode[w] + stall[w]
//!
//! home        = the available worker with the longest device prefix of the
//!               prompt (the cheapest of them on a tie), if any holds one
//! choice      = argmin cost, unless cost[home] − cost_at_home's_pace[choice]
//!               ≤ stickiness · step[home]: then home
//! ```
//!
//! `prefill_ms` is the dispatcher's prefill-duration estimator (the engines'
//! timing model, fitted per worker online), so the cost is in the same
//! milliseconds the prefill hints are; `restore_ms` is its restore model
//! (`tokens × restore_ms_per_token / speedup`, the engines' copy time over
//! their host-to-device link). A host-tier hit is thus credited by what it
//! costs — a copy, far cheaper than a prefill at the default bandwidth but
//! not free — rather than counted as a miss; restored tokens are not
//! recompute, so the locality and turnover terms leave them out. Bookings
//! still record the device overlap alone
//! ([`super::Decision::overlap_blocks`]), so a worker's queued prefill
//! counts a booked request's restored tokens as work (an overestimate of
//! the queue, never an underestimate). `first` is the time the worker needs
//! to compute the uncached prefill queued before this request (chunked
//! prefill is first come, first served) plus this request's own, with one
//! decode token per running request riding in the batch, after the step
//! the worker is running when the request lands: on average half a
//! decode-only step, whose length grows with the KV memory the worker's
//! running requests hold (the engines' decode curve, `decode_step_ms`).
//! So the decode load costs a worker what it delays this request by, not
//! one block per block held (the `kv` policy's trade). `locality` is the future value of
//! keeping a prefix where it lives: every token computed again here is a
//! second copy in the fleet's KV memory, evicting something else, and the
//! prefix's next user (a session's next turn, a shared system prompt) finds
//! it on the worker that already had it. With `locality_weight` 0 the policy
//! is greedy on this request's time to first token. `pressure` is what
//! piling onto one worker costs later: the KV memory its running requests
//! hold is memory its cache cannot keep, so the fuller it is, the likelier
//! this prompt (and everyone else's) must be computed again from scratch;
//! it grows with the square of the worker's KV usage, so it is near zero
//! until a worker fills up (a worker that reported no capacity has none).
//! `turnover` is what writing `new` tokens into a busy cache evicts: a
//! worker that was given its whole KV capacity's worth of new tokens in the
//! last minute or so ([`crate::router::WRITES_TIME_CONSTANT_MS`]) is pushing
//! out prefixes that are still young and likely to be asked for again; an
//! idle worker's oldest blocks are cheap to lose. `decode` is the time of
//! `decode_weight` of the request's own decode steps on the worker, once
//! it runs there: a worker whose running requests hold more KV memory
//! steps slower, for this request and for every request that joins it
//! later. Where a session's first turn lands, its later turns follow (the
//! locality term keeps them there), so this spreads new sessions over the
//! fleet by the decode load each worker already carries. It is off by
//! default (`decode_weight` 0): measured end to end it moved sessions off
//! their prefixes more than it balanced them (see [`TtftConfig`]).
//! `stall` is what this request's prefill costs the requests already
//! running on the worker: the engine runs it as a step every running
//! request waits out (a decode token rides in it, but the step takes the
//! prefill's time), so each of them is delayed by that step's length less
//! the decode step it would have run anyway. It grows with the running
//! requests and with the uncached tokens,
//! so a cold prompt (a new conversation, whose later turns will follow it)
//! goes where fewer requests run, while a session's next turn, with few
//! new tokens on its own worker, stays. With `interference_weight` 0.25 a
//! running request's delay counts a quarter of this request's own wait.
//! (Charged the whole prefill, the step's fixed part made every short
//! prompt look as costly to its neighbours as a long one, and sessions
//! moved off their history for it: ShareGPT conversations in the
//! simulator kept 0.609 of their prompt tokens cached against 0.615 with
//! the difference.)
//!
//! `stickiness` keeps a prompt with the worker holding its longest cached
//! prefix — a session's history, a shared system prompt — unless another
//! worker is cheaper by more than `stickiness` decode steps of that worker,
//! both priced at that worker's pace (a move is for what the other
//! worker's state saves, not for a learned difference in speed, which
//! among alike workers is the online fit's noise).
//! The costs are estimates: where a request lands between two steps moves
//! its wait by up to a step, and a fit learned under noise moves a
//! worker's prefill estimate by more, so a difference of a few steps is
//! not a reliable saving, while the move certainly recomputes the prefix
//! and leaves a stale copy behind. End to end on ShareGPT conversations,
//! without it 44 of 1,163 later turns in one run moved off their
//! session's worker, most for cost differences of 1–5 ms, and the
//! engines' hit rate stayed 0.002–0.005 under session-sticky routing
//! (docs/simulator.md). A real difference — a long prefill queued ahead
//! on the holder, a full worker — still moves it.
//!
//! **Fan-out.** `active[w]` is the prompt's leading blocks held by requests
//! already booked on `w` ([`Candidate::active_prompt_blocks`]). A burst of
//! requests sharing a prefix no worker has cached yet (sub-agents started
//! at once from their parent's context, best-of-N siblings) reaches the
//! router before any KV event says where the prefix went; the first of
//! them is booked, and the rest see its prompt blocks active on its
//! worker. The engine computes them before a later request's prefill (its
//! prefill queue is first come, first served, and `ahead[w]` already
//! counts the first one's tokens) and shares them, so for the rest that
//! worker's cost is the wait for the first one's prefill plus their own
//! suffix, while any other worker computes the whole prefix again and
//! pays `locality` for the second copy. The burst stays together until
//! the queue on the first worker costs more than that second prefill
//! would: the duplicated work is counted, not only this request's wait.
//! The booking records the active blocks as cached, so the worker's
//! prefill backlog counts the prefix once.
//!
//! **Peer restore.** When the dispatcher's estimator has a link between
//! workers ([`super::PrefillTime::transfer_ms`]; only the simulator gives
//! it one), each worker is also priced as if lent the prompt's longest
//! cached prefix by `home`: its cost with that prefix cached, plus the
//! transfer of the blocks it lacks before its first token. The cheaper of
//! the two is its cost; when the lent one wins (stickiness applies as
//! above), the decision names `home` as the source
//! ([`super::PeerSource`]) and books the lent blocks as cached.
//!
//! Ties (an instant engine's zero times, equal workers) go to fewer new
//! tokens, then fewer running requests, then the seeded RNG.

use super::{
    argmin_random_tie, at_least, Candidate, Decision, PeerSource, PolicyConfigError,
    RoutingContext, SelectOutcome, Selector,
};
use crate::types::WorkerId;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

/// Settings of the `ttft` policy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TtftConfig {
    /// Weight of the recompute a choice adds to the fleet (0: greedy on
    /// this request's time to first token).
    pub locality_weight: f64,
    /// Weight of KV-memory pressure (0: ignore how full a worker is).
    pub pressure_weight: f64,
    /// Weight of cache turnover (0: ignore how fast a worker's cache is
    /// being rewritten).
    pub turnover_weight: f64,
    /// Decode steps of the request's own output priced at the worker's
    /// pace (0, the default: ignore how fast a worker decodes). Off by
    /// default: end to end on multi-turn chat it moved sessions off their
    /// prefixes (hit rate 0.635 at 0, 0.620 at 8, 0.596 at 16; one run
    /// each, `bench versus`, docs/simulator.md).
    pub decode_weight: f64,
    /// Weight of the stall this request's prefill imposes on the requests
    /// already running on the worker, against its own time to first token
    /// (0: ignore; 1: every running request's delay counts as much as this
    /// request's own wait).
    pub interference_weight: f64,
    /// Decode steps of the worker holding the longest cached prefix of a
    /// prompt that another worker must save to take the request from it
    /// (0: the cheapest worker always wins).
    pub stickiness: f64,
}

impl Default for TtftConfig {
    fn default() -> Self {
        Self {
            locality_weight: 1.0,
            pressure_weight: 4.0,
            turnover_weight: 1.0,
            decode_weight: 0.0,
            interference_weight: 0.25,
            stickiness: 4.0,
        }
    }
}

impl TtftConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), PolicyConfigError> {
        at_least("locality_weight", self.locality_weight, 0.0).map_err(PolicyConfigError::Ttft)?;
        at_least("pressure_weight", self.pressure_weight, 0.0).map_err(PolicyConfigError::Ttft)?;
        at_least("turnover_weight", self.turnover_weight, 0.0).map_err(PolicyConfigError::Ttft)?;
        at_least("decode_weight", self.decode_weight, 0.0).map_err(PolicyConfigError::Ttft)?;
        at_least("interference_weight", self.interference_weight, 0.0)
            .map_err(PolicyConfigError::Ttft)?;
        at_least("stickiness", self.stickiness, 0.0).map_err(PolicyConfigError::Ttft)
    }
}

/// The `ttft` policy.
#[derive(Debug)]
pub struct TtftSelector {
    config: TtftConfig,
    rng: StdRng,
}

/// One candidate's cost, in parts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftCost {
    /// Uncached prompt tokens on this worker (neither on its device nor
    /// restorable from its host tier).
    pub new_tokens: u64,
    /// Prompt tokens restored from the worker's host tier.
    pub restored_tokens: u64,
    /// The restore's share of `first_token_ms`.
    pub restore_ms: f64,
    /// Expected wall ms until this request's first token there, the
    /// restore included.
    pub first_token_ms: f64,
    /// The locality term, in ms.
    pub locality_ms: f64,
    /// The KV-pressure term, in ms.
    pub pressure_ms: f64,
    /// The cache-turnover term, in ms.
    pub turnover_ms: f64,
    /// The decode-pace term, in ms.
    pub decode_ms: f64,
    /// The stall term (`interference_weight`), in ms.
    pub interference_ms: f64,
}

impl TtftCost {
    /// The total the policy minimizes.
    pub fn total(&self) -> f64 {
        self.first_token_ms
            + self.locality_ms
            + self.pressure_ms
            + self.turnover_ms
            + self.decode_ms
            + self.interference_ms
    }
}

impl TtftSelector {
    /// A selector with a seeded RNG (ties only).
    pub fn new(config: TtftConfig, seed: u64) -> Self {
        Self {
            config,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The cost of routing the request in `ctx` to `c`.
    pub fn cost(&self, ctx: &RoutingContext<'_>, c: &Candidate) -> TtftCost {
        self.config
            .cost_priced_as(ctx, c, c.worker, lend_on_offer(ctx))
    }
}

/// The pricing reads only the weights: the selector's tie-breaking RNG
/// stays free to borrow beside them.
impl TtftConfig {
    /// The cost of routing the request to `c` were `c` as fast as `priced`
    /// (its state — cache, queue, running requests — is `c`'s own).
    #[inline(always)]
    fn cost_priced_as(
        &self,
        ctx: &RoutingContext<'_>,
        c: &Candidate,
        priced: crate::types::WorkerId,
        lend: Option<u32>,
    ) -> TtftCost {
        let prompt = u64::from(ctx.request.prompt_tokens);
        let block_size = u64::from(ctx.block_size);
        let cached = (u64::from(pending(c, lend)) * block_size).min(prompt);
        let restored_tokens = (u64::from(c.host_overlap_blocks) * block_size).min(prompt - cached);
        let new_tokens = prompt - cached - restored_tokens;
        let ahead = c.active_prefill_tokens + c.active_requests as u64;
        // Half the decode step the worker is in when the request lands.
        let decode_step_ms = full_decode_step_ms(ctx, c, priced);
        let wait_ms = 0.5 * decode_step_ms;
        let restore_ms = if restored_tokens == 0 {
            0.0
        } else {
            ctx.prefill.restore_ms(priced, restored_tokens)
        };
        // A worker without the request's adapter loads it first.
        let first_token_ms = wait_ms
            + ctx.prefill.prefill_ms(priced, ahead + new_tokens)
            + restore_ms
            + c.adapter_load_ms;
        // This request's own uncached prefill, priced once for the terms
        // that weigh it.
        let own_ms = if new_tokens == 0 {
            0.0
        } else {
            ctx.prefill.prefill_ms(priced, new_tokens)
        };
        // A hybrid worker recomputing the part of its device prefix it
        // holds without an SSM state adds no second copy to the fleet: the
        // locality term counts only the tokens it does not hold.
        let held_tokens = (u64::from(held(c).max(pending(c, lend))) * block_size)
            .clamp(cached, prompt - restored_tokens);
        let fleet_new = prompt - held_tokens - restored_tokens;
        let locality_ms = self.locality_weight
            * if fleet_new == new_tokens {
                own_ms
            } else if fleet_new == 0 {
                0.0
            } else {
                ctx.prefill.prefill_ms(priced, fleet_new)
            };
        // The worker's KV usage once this request runs there.
        let usage_after = c.kv_capacity_blocks.map(|capacity| {
            let adds = ctx
                .prompt_blocks()
                .saturating_sub(u64::from(c.active_prompt_blocks));
            let held = c.active_decode_blocks as u64 + adds;
            (held as f64 / capacity.max(1) as f64).min(1.0)
        });
        let pressure_ms = match usage_after {
            Some(usage) if self.pressure_weight > 0.0 => {
                self.pressure_weight * usage * usage * ctx.prefill.prefill_ms(priced, prompt)
            }
            _ => 0.0,
        };
        // Each running request's step grows from a decode-only step to a
        // step that computes this prompt with its decode token riding in.
        let interference_ms = if new_tokens == 0 || c.active_requests == 0 {
            0.0
        } else {
            let mixed_ms = ctx
                .prefill
                .prefill_ms(priced, new_tokens + c.active_requests as u64);
            self.interference_weight
                * c.active_requests as f64
                * (mixed_ms - decode_step_ms).max(0.0)
        };
        let decode_ms = if self.decode_weight > 0.0 {
            self.decode_weight
                * ctx
                    .prefill
                    .decode_step_ms(priced, usage_after.unwrap_or(0.0))
        } else {
            0.0
        };
        let turnover_ms = match c.kv_capacity_blocks {
            Some(capacity) if self.turnover_weight > 0.0 && new_tokens > 0 => {
                let capacity_tokens = (capacity * u64::from(ctx.block_size)).max(1) as f64;
                let rewritten = (c.recent_writes_tokens / capacity_tokens).min(1.0);
                self.turnover_weight * rewritten * own_ms
            }
            _ => 0.0,
        };
        TtftCost {
            new_tokens,
            restored_tokens,
            restore_ms,
            first_token_ms,
            locality_ms,
            pressure_ms,
            turnover_ms,
            decode_ms,
            interference_ms,
        }
    }
}

impl TtftConfig {
    /// `home` — the cheapest holder of the longest cached prefix of the
    /// prompt, with its cost — keeps the request unless `chosen`, priced at
    /// the home's pace (and lent the prefix, when that is what made it the
    /// choice), saves more than `stickiness` of its decode steps.
    fn stay_home<'c>(
        &self,
        ctx: &RoutingContext<'c>,
        chosen: &'c Candidate,
        (home, home_ms): (&'c Candidate, f64),
        lend: Option<u32>,
    ) -> &'c Candidate {
        if self.stickiness <= 0.0 || held(chosen) == held(home) {
            return chosen;
        }
        // The saving as the home's pace prices both: a move is made for
        // what the other worker's state saves, not for a difference in
        // learned speed, which among alike workers is the fit's noise.
        let chosen_ms = self.best_cost(ctx, chosen, home.worker, lend).0.total();
        let saving = home_ms - chosen_ms;
        if saving <= self.stickiness * full_decode_step_ms(ctx, home, home.worker) {
            home
        } else {
            chosen
        }
    }

    /// `c`'s cost at `priced`'s pace, and whether it is the cost of being
    /// lent the prompt's longest cached prefix (`lend`: its length in
    /// blocks, when the driver can move KV between workers) by the worker
    /// holding it rather than computing what `c` lacks: the transfer,
    /// then `c`'s queue and the prefill of what is still uncached.
    fn best_cost(
        &self,
        ctx: &RoutingContext<'_>,
        c: &Candidate,
        priced: crate::types::WorkerId,
        lend: Option<u32>,
    ) -> (TtftCost, bool) {
        let own = self.cost_priced_as(ctx, c, priced, lend);
        let Some(longest) = lend.filter(|&l| l > c.overlap_blocks) else {
            return (own, false);
        };
        let prompt = u64::from(ctx.request.prompt_tokens);
        let moved = (u64::from(longest - c.overlap_blocks) * u64::from(ctx.block_size))
            .min(prompt.saturating_sub(u64::from(c.overlap_blocks) * u64::from(ctx.block_size)));
        let Some(transfer_ms) = ctx.prefill.transfer_ms(priced, moved) else {
            return (own, false);
        };
        let lent = Candidate {
            overlap_blocks: longest,
            host_overlap_blocks: 0,
            ..*c
        };
        let mut cost = self.cost_priced_as(ctx, &lent, priced, lend);
        cost.first_token_ms += transfer_ms;
        if cost.total() < own.total() {
            (cost, true)
        } else {
            (own, false)
        }
    }
}

/// The prompt's leading blocks `c` will have cached when this request's
/// prefill runs there: those cached on its device, or, when longer, those
/// an active request ahead of it holds — a sibling of a fan-out being
/// prefilled now, whose blocks the engine computes before this request's
/// turn comes (chunked prefill is first come, first served) and shares.
///
/// Not while a peer restore is on offer (`lend`): a holder lends its
/// cached prefix instead, and blocks on their way to a worker by a
/// transfer are not shared before they land.
fn pending(c: &Candidate, lend: Option<u32>) -> u32 {
    if lend.is_some() {
        c.overlap_blocks
    } else {
        c.overlap_blocks.max(c.active_prompt_blocks)
    }
}

/// The prompt blocks `c` holds on its device, resumable or not (never
/// fewer than those it can resume). Blocks only active there do not make
/// a worker the prompt's home: its cost counts them ([`pending`]), and
/// measured on the Mooncake trace, letting them also pick the worker that
/// stickiness keeps a prompt on made TTFT worse (p90 166.5 ms against
/// 162.6, `replay`, 2026-12-06).
fn held(c: &Candidate) -> u32 {
    c.held_prefix_blocks.max(c.overlap_blocks)
}

/// The prompt's longest device prefix, when some worker holds one and the
/// driver can move KV between workers (the dispatcher's estimator has a
/// link): a peer restore is on offer.
fn lend_on_offer(ctx: &RoutingContext<'_>) -> Option<u32> {
    let longest = ctx.available().map(|c| c.overlap_blocks).max().unwrap_or(0);
    (longest > 0)
        .then_some(longest)
        .filter(|_| ctx.prefill.transfer_ms(WorkerId::new(0), 0).is_some())
}

/// One decode-only step of `c` at the KV memory its running requests hold
/// (0 when it runs nothing), at `priced`'s pace.
fn full_decode_step_ms(
    ctx: &RoutingContext<'_>,
    c: &Candidate,
    priced: crate::types::WorkerId,
) -> f64 {
    if c.active_requests == 0 {
        return 0.0;
    }
    ctx.prefill.decode_step_ms(priced, c.held_share())
}

impl Selector for TtftSelector {
    fn name(&self) -> &'static str {
        "ttft"
    }

    fn select(&mut self, ctx: &RoutingContext<'_>) -> SelectOutcome {
        let (config, rng) = (&self.config, &mut self.rng);
        let longest = ctx.available().map(|c| c.overlap_blocks).max().unwrap_or(0);
        let lend = lend_on_offer(ctx);
        // The cheapest holder of the longest device prefix, found in the
        // same pass: for hybrid workers the prefix held, resumable or not
        // (the holder keeps the branch point's SSM state for the turns
        // after; the cost prices only what it can resume now).
        let longest_held = ctx.available().map(held).max().unwrap_or(0);
        let mut home: Option<(crate::types::WorkerId, f64)> = None;
        let mut best = argmin_random_tie(ctx.available(), rng, |c| {
            let (cost, _) = config.best_cost(ctx, c, c.worker, lend);
            let total = cost.total();
            if longest_held > 0 && held(c) == longest_held && home.is_none_or(|(_, ms)| total < ms)
            {
                home = Some((c.worker, total));
            }
            (total, cost.new_tokens, c.active_requests)
        });
        let home = home.and_then(|(worker, ms)| {
            let c = ctx.available().find(|c| c.worker == worker)?;
            Some((c, ms))
        });
        if let (Some(chosen), Some(home)) = (best, home) {
            best = Some(config.stay_home(ctx, chosen, home, lend));
        }
        match best {
            Some(c) => {
                // Lent by the home when that is what its cost was.
                let peer = home
                    .filter(|(h, _)| h.worker != c.worker && h.overlap_blocks == longest)
                    .filter(|_| config.best_cost(ctx, c, c.worker, lend).1)
                    .map(|(h, _)| PeerSource {
                        holder: h.worker,
                        blocks: longest,
                    });
                SelectOutcome::Selected(Decision {
                    worker: c.worker,
                    overlap_blocks: if peer.is_some() {
                        longest
                    } else {
                        pending(c, lend)
                    },
                    peer,
                })
            }
            None => ctx.unavailable(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::types::LocalHash;

    fn blocks(n: u64) -> Vec<LocalHash> {
        (0..n).map(LocalHash).collect()
    }

    /// [`LINEAR`] with a link between workers: 1 ms plus 0.05 ms a token.
    struct Linked;

    impl crate::select::PrefillTime for Linked {
        fn prefill_ms(&self, w: crate::types::WorkerId, tokens: u64) -> f64 {
            LINEAR.prefill_ms(w, tokens)
        }
        fn decode_step_ms(&self, w: crate::types::WorkerId, usage: f64) -> f64 {
            LINEAR.decode_step_ms(w, usage)
        }
        fn restore_ms(&self, w: crate::types::WorkerId, tokens: u64) -> f64 {
            LINEAR.restore_ms(w, tokens)
        }
        fn transfer_ms(&self, _: crate::types::WorkerId, tokens: u64) -> Option<f64> {
            Some(1.0 + 0.05 * tokens as f64)
        }
    }

    #[test]
    fn an_idle_worker_is_lent_the_prefix_a_busy_holder_would_make_it_wait_for() {
        let b = blocks(64);
        // The holder has 60 of the 64 blocks but 5,000 tokens queued.
        let mut holder = candidate(1);
        holder.overlap_blocks = 60;
        holder.active_prefill_tokens = 5_000;
        holder.active_requests = 1;
        let idle = candidate(2);
        let cands = [holder, idle];
        let mut s = TtftSelector::new(TtftConfig::default(), 0);
        // Without a link the idle worker computes all 1,024 tokens.
        let plain = s.select(&ctx(&b, 1024, &cands));
        assert_eq!(
            plain,
            SelectOutcome::Selected(Decision {
                worker: idle.worker,
                overlap_blocks: 0,
                peer: None
            })
        );
        // With one, it restores the 60 blocks from the holder (48.0 ms of
        // transfer, then 64 tokens) rather than compute them.
        let lent = s.select(&ctx_with_model(&b, 1024, &cands, &Linked));
        assert_eq!(
            lent,
            SelectOutcome::Selected(Decision {
                worker: idle.worker,
                overlap_blocks: 60,
                peer: Some(PeerSource {
                    holder: holder.worker,
                    blocks: 60
                })
            })
        );
        // An idle holder keeps its prompt: nothing moves.
        let quiet = Candidate {
            active_prefill_tokens: 0,
            active_requests: 0,
            ..holder
        };
        let kept = s.select(&ctx_with_model(&b, 1024, &[quiet, idle], &Linked));
        assert_eq!(
            kept,
            SelectOutcome::Selected(Decision {
                worker: holder.worker,
                overlap_blocks: 60,
                peer: None
            })
        );
    }

    #[test]
    fn a_peer_restore_is_priced_transfer_then_queue_then_what_is_still_uncached() {
        let b = blocks(64);
        let mut holder = candidate(1);
        holder.overlap_blocks = 60;
        let mut c = candidate(2);
        c.overlap_blocks = 20;
        c.active_prefill_tokens = 100;
        let s = TtftSelector::new(TtftConfig::default(), 0);
        let (cost, lent) = s.config.best_cost(
            &ctx_with_model(&b, 1024, &[holder, c], &Linked),
            &c,
            c.worker,
            Some(60),
        );
        assert!(lent);
        // 40 blocks (640 tokens) moved: 1 + 32 ms; then the 100 queued
        // tokens and the 64 still uncached.
        assert_eq!(cost.first_token_ms, 33.0 + 100.0 + 64.0);
        assert_eq!(cost.new_tokens, 64);
    }

    #[test]
    fn the_cost_is_the_queued_and_own_prefill_time_plus_the_recompute() {
        // The linear model of test_support: 1 ms per token, no chunking.
        let s = TtftSelector::new(TtftConfig::default(), 0);
        let b = blocks(4);
        let mut c = candidate(1);
        c.overlap_blocks = 2; // 32 of 64 tokens cached
        c.active_prefill_tokens = 100;
        c.active_requests = 3;
        let cost = s.cost(&ctx(&b, 64, &[c]), &c);
        assert_eq!(cost.new_tokens, 32);
        // Half a decode step at an unknown (so empty) cache: 10 / 2 ms.
        assert_eq!(cost.first_token_ms, 5.0 + 100.0 + 3.0 + 32.0);
        assert_eq!(cost.locality_ms, 32.0);
        assert_eq!(cost.decode_ms, 0.0, "off by default");
        // The 3 running requests' step grows from a 10 ms decode step to
        // the prefill of 32 + 3 tokens: 0.25 · 3 · (35 − 10).
        assert_eq!(cost.interference_ms, 18.75);
        assert_eq!(cost.total(), 190.75);
        let paced = TtftSelector::new(
            TtftConfig {
                decode_weight: 8.0,
                ..TtftConfig::default()
            },
            0,
        );
        // Eight decode steps at an unknown (so empty) cache: 8 · 10 ms.
        assert_eq!(paced.cost(&ctx(&b, 64, &[c]), &c).decode_ms, 80.0);
    }

    #[test]
    fn a_host_tier_hit_is_charged_its_restore_time_not_a_miss() {
        // An 8-block prompt of 128 tokens (16-token blocks); both workers
        // idle, no capacity reported (no pressure or turnover). Linear
        // model: prefill 1 ms a token; restores r ms a token.
        //
        //   A: 4 device blocks.           cached 64, restored 0, new 64:
        //      first 64, locality 64                      → 128 ms
        //   B: 1 device block + 7 host.   cached 16, restored 112, new 0:
        //      first 0 + 112·r, locality 0                → 112·r ms
        //
        // B wins while 112·r < 128, i.e. r < 8/7 ms a token.
        let b = blocks(8);
        let mut device = candidate(1);
        device.overlap_blocks = 4;
        let mut host = candidate(2);
        host.overlap_blocks = 1;
        host.host_overlap_blocks = 7;
        let s = TtftSelector::new(TtftConfig::default(), 0);
        let cands = [device, host];

        let cheap = LinearModel {
            restore_ms_per_token: 0.1,
        };
        let cx = ctx_with_model(&b, 128, &cands, &cheap);
        let a = s.cost(&cx, &device);
        assert_eq!((a.new_tokens, a.restored_tokens), (64, 0));
        assert_eq!(
            (a.first_token_ms, a.locality_ms, a.total()),
            (64.0, 64.0, 128.0)
        );
        let h = s.cost(&cx, &host);
        assert_eq!((h.new_tokens, h.restored_tokens), (0, 112));
        assert!((h.restore_ms - 11.2).abs() < 1e-9, "{h:?}");
        assert!((h.first_token_ms - 11.2).abs() < 1e-9, "{h:?}");
        assert_eq!(h.locality_ms, 0.0, "a restore is not recompute");
        assert!((h.total() - 11.2).abs() < 1e-9, "{h:?}");
        let mut p = TtftSelector::new(TtftConfig::default(), 0);
        assert_eq!(chosen(p.select(&cx)), 2);

        // At 2 ms a token the copy costs 224 ms against A's 128: A wins.
        let dear = LinearModel {
            restore_ms_per_token: 2.0,
        };
        let cx = ctx_with_model(&b, 128, &cands, &dear);
        assert_eq!(s.cost(&cx, &host).total(), 224.0);
        assert_eq!(chosen(p.select(&cx)), 1);

        // Counted as a miss (no host credit), B would cost 112 + 112.
        let mut blind = host;
        blind.host_overlap_blocks = 0;
        assert_eq!(s.cost(&cx, &blind).total(), 224.0);
        assert_eq!(s.cost(&cx, &blind).restore_ms, 0.0);
    }

    #[test]
    fn host_blocks_restore_no_more_than_the_prompt_left_after_the_device_hit() {
        // 64-token prompt (4 blocks). 2 device blocks leave 32 tokens; a
        // claim of 10 host blocks (160 tokens) restores only those 32.
        let b = blocks(4);
        let mut c = candidate(1);
        c.overlap_blocks = 2;
        c.host_overlap_blocks = 10;
        let s = TtftSelector::new(TtftConfig::default(), 0);
        let cost = s.cost(&ctx(&b, 64, &[c]), &c);
        assert_eq!((cost.new_tokens, cost.restored_tokens), (0, 32));
        assert!((cost.first_token_ms - 3.2).abs() < 1e-9, "{cost:?}");
    }

    #[test]
    fn a_hot_prefix_stays_on_a_busier_worker_while_the_wait_is_worth_it() {
        // 1,024-token prompt; w1 holds 960 tokens of it and has 300 tokens
        // of prefill queued; w2 is idle and cold.
        let b = blocks(64);
        let mut hot = candidate(1);
        hot.overlap_blocks = 60;
        hot.active_prefill_tokens = 300;
        hot.active_requests = 4;
        let cold = candidate(2);
        let mut s = TtftSelector::new(TtftConfig::default(), 0);
        // hot: 300 + 4 + 64 = 368 ms, +64 locality = 432; cold: 1024 + 1024.
        assert_eq!(chosen(s.select(&ctx(&b, 1024, &[hot, cold]))), 1);
        // Greedy on time alone it is still faster: 368 against 1,024 ms.
        let mut greedy = TtftSelector::new(
            TtftConfig {
                locality_weight: 0.0,
                ..TtftConfig::default()
            },
            0,
        );
        assert_eq!(chosen(greedy.select(&ctx(&b, 1024, &[hot, cold]))), 1);
        // With 3,000 tokens queued the hot worker loses, recompute counted:
        // 3,068 + 64 against 1,024 + 1,024 ms.
        hot.active_prefill_tokens = 3000;
        assert_eq!(chosen(s.select(&ctx(&b, 1024, &[hot, cold]))), 2);
    }

    #[test]
    fn a_fan_out_sibling_joins_the_worker_prefilling_its_prefix_while_the_wait_is_worth_it() {
        // 1,024-token prompt, nothing cached anywhere. w1 is prefilling a
        // sibling that shares the first 60 blocks (960 tokens): they are
        // active there, 1,000 tokens of prefill queued, one request.
        let b = blocks(64);
        let mut sibling = candidate(1);
        sibling.active_prompt_blocks = 60;
        sibling.active_prefill_tokens = 1000;
        sibling.active_requests = 1;
        let idle = [candidate(2), candidate(3)];
        let cands = [sibling, idle[0], idle[1]];
        let mut s = TtftSelector::new(TtftConfig::default(), 0);
        // w1: 5 ms of a step + 1,000 + 1 + 64 = 1,070 ms, 64 of locality,
        // a quarter of the sibling's stall; an idle worker: 1,024 ms and
        // 1,024 more for the prefix's second copy.
        let cost = s.cost(&ctx(&b, 1024, &cands), &sibling);
        assert_eq!(cost.new_tokens, 64);
        assert_eq!(
            s.select(&ctx(&b, 1024, &cands)),
            SelectOutcome::Selected(Decision {
                worker: sibling.worker,
                // Booked as cached: the worker's backlog counts the prefix once.
                overlap_blocks: 60,
                peer: None,
            })
        );
        // Blind to the active prefix, the idle workers are cheaper (1,024
        // + 1,024 against 1,069 + 1,024): the burst would be prefilled on
        // every worker.
        let mut blind = sibling;
        blind.active_prompt_blocks = 0;
        let cands_blind = [blind, idle[0], idle[1]];
        assert_ne!(chosen(s.select(&ctx(&b, 1024, &cands_blind))), 1);
        // Once the queue there costs more than a second prefill of the
        // prefix (2,100 tokens ahead: 2,170 + 64 and the stall against
        // 1,024 + 1,024), the request goes elsewhere.
        sibling.active_prefill_tokens = 2_100;
        let cands = [sibling, idle[0], idle[1]];
        assert_ne!(chosen(s.select(&ctx(&b, 1024, &cands))), 1);
    }

    #[test]
    fn a_prompt_stays_with_its_longest_prefix_unless_a_move_saves_four_decode_steps() {
        // 64-token prompt. w1 holds its first block (16 tokens), runs 2
        // requests (decode step 10 ms: no capacity reported) and has `X`
        // tokens of prefill queued; w2 is idle and cold.
        //   w1: wait 5 + prefill(X + 2 + 48) + locality 48
        //       + stall 0.25 · 2 · (50 − 10)                = X + 123 ms
        //   w2: prefill 64 + locality 64                      = 128 ms
        let b = blocks(4);
        let mut home = candidate(1);
        home.overlap_blocks = 1;
        home.active_requests = 2;
        let cold = candidate(2);
        let mut sticky = TtftSelector::new(TtftConfig::default(), 0);
        let mut greedy = TtftSelector::new(
            TtftConfig {
                stickiness: 0.0,
                ..TtftConfig::default()
            },
            0,
        );
        // X = 30: w2 is 25 ms cheaper, less than 4 of w1's 10 ms steps.
        home.active_prefill_tokens = 30;
        let c = [home, cold];
        assert_eq!(sticky.cost(&ctx(&b, 64, &c), &home).total(), 153.0);
        assert_eq!(chosen(greedy.select(&ctx(&b, 64, &c))), 2);
        assert_eq!(chosen(sticky.select(&ctx(&b, 64, &c))), 1);
        // X = 60: 55 ms cheaper, more than 40: it moves.
        home.active_prefill_tokens = 60;
        let c = [home, cold];
        assert_eq!(chosen(sticky.select(&ctx(&b, 64, &c))), 2);
        // A busy holder is not waited for.
        home.active_prefill_tokens = 30;
        home.busy = true;
        let c = [home, cold];
        assert_eq!(chosen(sticky.select(&ctx(&b, 64, &c))), 2);
        // With no prefix anywhere the cheapest wins.
        home.busy = false;
        home.overlap_blocks = 0;
        let c = [home, cold];
        assert_eq!(chosen(sticky.select(&ctx(&b, 64, &c))), 2);
    }

    #[test]
    fn a_hybrid_holder_keeps_a_prompt_it_cannot_resume_unless_a_move_saves_four_steps() {
        // As above, but w1 is a hybrid worker holding the prompt's first
        // block with no SSM state there: it resumes nothing, so it
        // computes all 64 tokens, but the 16 it holds are no second copy
        // in the fleet (locality 48), and it will keep the branch point's
        // state for the turns after.
        //   w1: wait 5 + prefill(X + 2 + 64) + locality 48
        //       + stall 0.25 · 2 · (66 − 10)                = X + 147 ms
        //   w2: prefill 64 + locality 64                      = 128 ms
        let b = blocks(4);
        let mut home = candidate(1);
        home.held_prefix_blocks = 1;
        home.active_requests = 2;
        let cold = candidate(2);
        let mut sticky = TtftSelector::new(TtftConfig::default(), 0);
        // X = 20: w2 is 39 ms cheaper, less than 4 of w1's 10 ms steps.
        home.active_prefill_tokens = 20;
        let c = [home, cold];
        assert_eq!(sticky.cost(&ctx(&b, 64, &c), &home).total(), 167.0);
        assert_eq!(chosen(sticky.select(&ctx(&b, 64, &c))), 1);
        // X = 30: 49 ms cheaper, more than 40: it moves.
        home.active_prefill_tokens = 30;
        let c = [home, cold];
        assert_eq!(chosen(sticky.select(&ctx(&b, 64, &c))), 2);
        // Held by no one: the cheapest wins.
        home.active_prefill_tokens = 0;
        home.held_prefix_blocks = 0;
        let c = [home, cold];
        assert_eq!(chosen(sticky.select(&ctx(&b, 64, &c))), 2);
    }

    /// [`LinearModel`] with worker 1 fitted twice as slow.
    struct W1Slow;

    impl super::super::PrefillTime for W1Slow {
        fn prefill_ms(&self, w: crate::types::WorkerId, tokens: u64) -> f64 {
            LINEAR.prefill_ms(w, tokens) * if w.worker_id == 1 { 2.0 } else { 1.0 }
        }

        fn decode_step_ms(&self, w: crate::types::WorkerId, usage: f64) -> f64 {
            LINEAR.decode_step_ms(w, usage) * if w.worker_id == 1 { 2.0 } else { 1.0 }
        }

        fn restore_ms(&self, w: crate::types::WorkerId, tokens: u64) -> f64 {
            LINEAR.restore_ms(w, tokens)
        }
    }

    #[test]
    fn a_prompt_does_not_leave_its_prefix_for_a_worker_only_fitted_faster() {
        // 64-token prompt; w1 holds its first block, runs 2 requests and is
        // fitted twice as slow (2 ms a token, 20 ms steps); w2 is idle and
        // cold.
        //   w1: wait 10 + 2·(2 + 48) + locality 96 + stall 0.25·2·(100 − 20) = 246
        //   w2 at its own pace: 64 + 64 = 128; at w1's pace: 256
        let b = blocks(4);
        let mut home = candidate(1);
        home.overlap_blocks = 1;
        home.active_requests = 2;
        let cold = candidate(2);
        let mut s = TtftSelector::new(TtftConfig::default(), 0);
        let c = [home, cold];
        let cx = ctx_with_model(&b, 64, &c, &W1Slow);
        assert_eq!(s.cost(&cx, &home).total(), 246.0);
        assert_eq!(s.cost(&cx, &cold).total(), 128.0);
        // 118 ms cheaper at its own pace (more than 4 steps of 20 ms), but
        // nothing at w1's: it stays.
        assert_eq!(chosen(s.select(&cx)), 1);
        // A real difference in state still moves it: 100 tokens queued on
        // w1 make it 446 against w2's 256 at w1's pace.
        home.active_prefill_tokens = 100;
        let c = [home, cold];
        let cx = ctx_with_model(&b, 64, &c, &W1Slow);
        assert_eq!(s.cost(&cx, &home).total(), 446.0);
        assert_eq!(chosen(s.select(&cx)), 2);
    }

    #[test]
    fn a_negative_or_infinite_stickiness_is_refused() {
        for w in [-1.0, f64::INFINITY, f64::NAN] {
            let err = TtftConfig {
                stickiness: w,
                ..TtftConfig::default()
            }
            .validate()
            .unwrap_err();
            assert!(err.to_string().contains("stickiness"), "{err}");
        }
    }

    #[test]
    fn a_cold_prompt_weighs_the_queue_ahead_against_the_requests_it_would_stall() {
        // No worker has any of the 128-token prompt. w1 runs 20 decodes
        // and has nothing to prefill; w2 runs 1 and has 200 tokens queued.
        let b = blocks(8);
        let mut decoding = candidate(1);
        decoding.active_requests = 20;
        decoding.active_decode_blocks = 2_000;
        let mut prefilling = candidate(2);
        prefilling.active_prefill_tokens = 200;
        prefilling.active_requests = 1;
        let cands = [decoding, prefilling];
        let c = ctx(&b, 128, &cands);
        // On its own time alone w1 is sooner (5 + 148 against 5 + 329 ms:
        // the kv policy's block count gets this the other way round)...
        let own_time = TtftConfig {
            interference_weight: 0.0,
            ..TtftConfig::default()
        };
        assert_eq!(chosen(TtftSelector::new(own_time, 0).select(&c)), 1);
        // ...but its prefill would stall 20 running requests there, each
        // step growing from a 10 ms decode step to 128 + 20 tokens' prefill:
        // 0.25 · 20 · (148 − 10) = 690 ms, against 0.25 · 1 · (129 − 10)
        // = 29.75 on w2.
        let mut s = TtftSelector::new(TtftConfig::default(), 0);
        assert_eq!(s.cost(&c, &decoding).interference_ms, 690.0);
        assert_eq!(s.cost(&c, &prefilling).interference_ms, 29.75);
        assert_eq!(chosen(s.select(&c)), 2);
    }

    #[test]
    fn a_cold_prompt_waits_half_a_decode_step_and_fuller_workers_step_slower() {
        // Both workers cold, nothing to prefill, 4 running requests each;
        // capacity 64 blocks. LinearModel's decode step is 10 + 40·usage ms.
        let b = blocks(2);
        let only_time = TtftConfig {
            locality_weight: 0.0,
            pressure_weight: 0.0,
            turnover_weight: 0.0,
            decode_weight: 0.0,
            interference_weight: 0.0,
            stickiness: 0.0,
        };
        let mut full = candidate(1);
        full.active_requests = 4;
        full.active_decode_blocks = 48; // usage 0.75: step 40 ms
        full.kv_capacity_blocks = Some(64);
        let mut light = full;
        light.worker = crate::types::WorkerId::new(2);
        light.active_decode_blocks = 16; // usage 0.25: step 20 ms
        let mut idle = light;
        idle.worker = crate::types::WorkerId::new(3);
        idle.active_requests = 0;
        idle.active_decode_blocks = 0;
        let mut s = TtftSelector::new(only_time, 0);
        let cands = [full, light, idle];
        let c = ctx(&b, 32, &cands);
        // wait + prefill of (4 decode tokens + 32 prompt tokens).
        assert_eq!(s.cost(&c, &full).first_token_ms, 20.0 + 36.0);
        assert_eq!(s.cost(&c, &light).first_token_ms, 10.0 + 36.0);
        // Nothing running: no step to wait for.
        assert_eq!(s.cost(&c, &idle).first_token_ms, 32.0);
        assert_eq!(chosen(s.select(&ctx(&b, 32, &[full, light]))), 2);
    }

    #[test]
    fn a_new_session_goes_where_the_decode_load_is_lighter_but_a_hot_prefix_stays() {
        // Capacity 100 blocks each; w1's running requests hold 60, w2's 10.
        // A cold 2-block prompt: usage after 0.62 against 0.12, so eight
        // steps cost 8 · (10 + 40 · 0.62) = 278.4 against 8 · 14.8 = 118.4
        // ms; everything else is equal.
        let b = blocks(2);
        let mut heavy = candidate(1);
        heavy.kv_capacity_blocks = Some(100);
        heavy.active_decode_blocks = 60;
        heavy.active_requests = 6;
        let mut light = heavy;
        light.worker = crate::types::WorkerId::new(2);
        light.active_decode_blocks = 10;
        let only_decode = TtftConfig {
            pressure_weight: 0.0,
            turnover_weight: 0.0,
            decode_weight: 8.0,
            ..TtftConfig::default()
        };
        let mut s = TtftSelector::new(only_decode, 0);
        let cands = [heavy, light];
        let c = ctx(&b, 32, &cands);
        assert!((s.cost(&c, &heavy).decode_ms - 278.4).abs() < 1e-9);
        assert!((s.cost(&c, &light).decode_ms - 118.4).abs() < 1e-9);
        assert_eq!(chosen(s.select(&c)), 2);
        // The session's next turn, 30 blocks (480 tokens) of it cached on
        // w1 only: moving costs 480 ms of prefill and 480 of recompute,
        // far more than the 160 ms of decode pace it would gain.
        let b = blocks(32);
        heavy.overlap_blocks = 30;
        heavy.active_prompt_blocks = 0;
        let cands = [heavy, light];
        assert_eq!(chosen(s.select(&ctx(&b, 512, &cands))), 1);
    }

    #[test]
    fn with_an_instant_engine_ties_go_to_the_cache_then_to_the_idler_worker() {
        let b = blocks(4);
        let mut busy_hot = candidate(1);
        busy_hot.overlap_blocks = 4;
        busy_hot.active_requests = 9;
        let idle_cold = candidate(2);
        let mut s = TtftSelector::new(TtftConfig::default(), 0);
        let cands = [busy_hot, idle_cold];
        let zero = ctx_with_model(&b, 64, &cands, &InstantModel);
        assert_eq!(
            chosen(s.select(&zero)),
            1,
            "all costs are 0: fewer new tokens"
        );
        let mut idle_hot = busy_hot;
        idle_hot.worker = crate::types::WorkerId::new(3);
        idle_hot.active_requests = 0;
        let cands = [busy_hot, idle_hot];
        let zero = ctx_with_model(&b, 64, &cands, &InstantModel);
        assert_eq!(chosen(s.select(&zero)), 3, "then fewer running requests");
    }

    #[test]
    fn kv_pressure_grows_with_the_square_of_the_workers_usage() {
        // 64-token prompt = 4 blocks; capacity 8 blocks; the prompt's 4
        // blocks are new here. Prefill of the whole prompt: 64 ms; the
        // default weight is 4.
        let s = TtftSelector::new(TtftConfig::default(), 0);
        let b = blocks(4);
        let mut c = candidate(1);
        c.kv_capacity_blocks = Some(8);
        assert_eq!(
            s.cost(&ctx(&b, 64, &[c]), &c).pressure_ms,
            4.0 * 0.25 * 64.0
        );
        c.active_decode_blocks = 4; // 8 of 8 blocks: full
        assert_eq!(s.cost(&ctx(&b, 64, &[c]), &c).pressure_ms, 4.0 * 64.0);
        c.active_decode_blocks = 100; // over capacity counts as full
        assert_eq!(s.cost(&ctx(&b, 64, &[c]), &c).pressure_ms, 4.0 * 64.0);
        // Blocks the worker's running requests already hold are not added.
        c.active_decode_blocks = 2;
        c.active_prompt_blocks = 4;
        assert_eq!(
            s.cost(&ctx(&b, 64, &[c]), &c).pressure_ms,
            4.0 * 0.0625 * 64.0
        );
        // No reported capacity, no pressure.
        c.kv_capacity_blocks = None;
        assert_eq!(s.cost(&ctx(&b, 64, &[c]), &c).pressure_ms, 0.0);
    }

    #[test]
    fn a_worker_rewriting_its_cache_fast_charges_its_new_tokens_again() {
        // 64-token prompt, 32 cached; capacity 8 blocks = 128 tokens.
        let s = TtftSelector::new(TtftConfig::default(), 0);
        let b = blocks(4);
        let mut c = candidate(1);
        c.overlap_blocks = 2;
        c.kv_capacity_blocks = Some(8);
        c.recent_writes_tokens = 64.0; // half its cache rewritten lately
        assert_eq!(s.cost(&ctx(&b, 64, &[c]), &c).turnover_ms, 0.5 * 32.0);
        c.recent_writes_tokens = 1e6; // more than all of it: capped at once
        assert_eq!(s.cost(&ctx(&b, 64, &[c]), &c).turnover_ms, 32.0);
        // A cold prompt on a churning worker loses to an idle one holding
        // nothing: 64 + 64 + 64 against 64 + 64 ms.
        let mut churning = candidate(1);
        churning.kv_capacity_blocks = Some(8);
        churning.recent_writes_tokens = 1e6;
        let mut idle = candidate(2);
        idle.kv_capacity_blocks = Some(8);
        let mut p = TtftSelector::new(
            TtftConfig {
                pressure_weight: 0.0,
                ..TtftConfig::default()
            },
            0,
        );
        assert_eq!(chosen(p.select(&ctx(&b, 64, &[churning, idle]))), 2);
    }

    #[test]
    fn a_negative_or_infinite_locality_weight_is_refused() {
        for w in [-1.0, f64::INFINITY, f64::NAN] {
            let err = TtftConfig {
                locality_weight: w,
                ..TtftConfig::default()
            }
            .validate()
            .unwrap_err();
            assert!(err.to_string().contains("locality_weight"), "{err}");
            let err = TtftConfig {
                pressure_weight: w,
                ..TtftConfig::default()
            }
            .validate()
            .unwrap_err();
            assert!(err.to_string().contains("pressure_weight"), "{err}");
            let err = TtftConfig {
                decode_weight: w,
                ..TtftConfig::default()
            }
            .validate()
            .unwrap_err();
            assert!(err.to_string().contains("decode_weight"), "{err}");
            let err = TtftConfig {
                interference_weight: w,
                ..TtftConfig::default()
            }
            .validate()
            .unwrap_err();
            assert!(err.to_string().contains("interference_weight"), "{err}");
        }
    }
}
