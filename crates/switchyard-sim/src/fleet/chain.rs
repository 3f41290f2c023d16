//! Responses API chains ([`FleetConfig::responses_chain`](super::FleetConfig)):
//! each turn of a multi-turn session stores its response on the worker
//! that answers it, and the next turn continues it there. The table is the
//! core's response affinity ([`ResponseAffinity`], `serve`'s too), one per
//! router replica: the replica that routed a turn records its response, and
//! with replica sync so do its peers.

use super::Simulation;
use switchyard_core::admission::responses::{Holder, Located, ResponseAffinity, Standing};
use switchyard_core::admission::SessionKey;
use switchyard_core::Eligible;

/// Stored responses a replica keeps, and for how long: `serve`'s defaults
/// (`--max-stored-responses`, `--stored-response-ttl-secs`).
const CAPACITY: usize = 100_000;
const TTL_MS: f64 = 24.0 * 3600.0 * 1e3;

/// Why the simulator refuses Responses chains in this configuration: a
/// disaggregated request's response lives on its decode worker but its
/// prompt is placed on a prefill pool, and data-parallel ranks share one
/// store per worker; neither is modelled.
pub(super) fn check(config: &super::FleetConfig) -> Result<(), super::SimError> {
    if config.responses_chain && (config.disagg.is_some() || config.dp.is_some()) {
        return Err(super::SimError::Chains(
            "not modelled with disaggregation or data-parallel ranks".to_owned(),
        ));
    }
    Ok(())
}

/// A replica's empty table.
pub(super) fn table() -> ResponseAffinity {
    ResponseAffinity::new(CAPACITY, CAPACITY, TTL_MS)
}

/// The response id turn `turn` of `session` stores.
fn response_id(session: u64, turn: usize) -> String {
    format!("resp_{session:016x}{turn:016x}")
}

impl Simulation {
    /// Where turn `turn` of `session` may go through `replica`: anywhere,
    /// unless it continues a response, which it may only where that is
    /// stored (`None`: known nowhere here).
    pub(super) fn chain_eligible(
        &mut self,
        replica: usize,
        session: u64,
        turn: usize,
    ) -> Option<Eligible> {
        if !self.config.responses_chain || turn == 0 {
            return Some(Eligible::Every);
        }
        let previous = response_id(session, turn - 1);
        let now = self.now;
        let (workers, by_worker_id) = (&self.workers, &self.by_worker_id);
        let standing = |w| match by_worker_id.get(&w) {
            None => Standing::Gone,
            Some(&engine) if workers[engine].down => Standing::OutOfSelection,
            Some(_) => Standing::InSelection,
        };
        // The router's decision, as `serve` takes it (its 404, 410 and 503
        // end the turn here too).
        let Located::At(holder) = self.replicas[replica]
            .responses
            .locate(&previous, None, now, standing)
        else {
            return None;
        };
        // A worker that failed and restarted since lost what it stored: the
        // turn ends at once, as a restarted engine answers an unknown
        // response id.
        let engine = self.by_worker_id[&holder.worker];
        let stored_epoch = self.chain_epochs.get(&session).copied();
        (stored_epoch == Some(self.workers[engine].epoch)).then(|| Eligible::one(holder.worker))
    }

    /// Turn `turn` of `session` answered on engine `worker` through
    /// `replica`: its response is stored there.
    pub(super) fn store_response(
        &mut self,
        replica: usize,
        worker: usize,
        session: u64,
        turn: usize,
    ) {
        if !self.config.responses_chain {
            return;
        }
        let holder = Holder {
            worker: self.workers[worker].id,
            session: Some(SessionKey(session)),
            owner: None,
        };
        let now = self.now;
        let id = response_id(session, turn);
        // With replica sync, the replica plane carries the entry to every
        // peer (`serve --replica-sync`; a peer that has not heard yet waits
        // 100 ms for it, longer than any modelled sync delay, so the entry
        // is taken as known everywhere at once). Without it only the
        // replica that routed the turn knows.
        if self.config.replicas.sync {
            for r in &mut self.replicas {
                r.responses.insert(&id, holder, now);
            }
        } else {
            self.replicas[replica].responses.insert(&id, holder, now);
        }
        self.chain_epochs
            .insert(session, self.workers[worker].epoch);
    }
}
