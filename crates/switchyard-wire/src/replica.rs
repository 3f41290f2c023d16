//! Replica events: one router replica's bookings, as its peers receive them.
//!
//! A message on the replica plane is one [`ReplicaBatch`] encoded as
//! MessagePack with `rmp-serde` (structs as arrays, so field names cost no
//! bytes). Transports that carry one event per message send batches of one;
//! an empty batch is a heartbeat that keeps its sender's bookings alive on
//! its peers.
//!
//! Why `rmp-serde` and not `rmpv` (which the engine-event decoder uses):
//! engine payloads have many historical shapes and need a tolerant,
//! hand-written walk over a value tree; replica events have one shape that
//! Switchyard owns, so derived serde code is shorter, decodes straight into
//! the types without an intermediate tree (the plane targets hundreds of
//! thousands of events a second), and still fails cleanly on bad input.
//!
//! Events carry ids, lengths and block hashes only, never prompt text.

use serde::{Deserialize, Serialize};
use switchyard_core::admission::SessionKey;
use switchyard_core::sequences::{AddRequest, SequenceEvent};
use switchyard_core::types::{LocalHash, ReplicaId, RequestId, WorkerId};

/// What happened to a request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ActiveSequenceData {
    /// The request was booked on the event's worker.
    AddRequest {
        /// Prompt length in tokens.
        prompt_tokens: u32,
        /// Local hashes of the prompt's full blocks.
        blocks: Vec<LocalHash>,
        /// Leading blocks the booking replica expected the worker to hold.
        overlap_blocks: u32,
        /// Expected prefill duration, when the booking replica modeled it.
        expected_prefill_ms: Option<f64>,
    },
    /// The request's first token arrived.
    MarkPrefillCompleted,
    /// The request ended.
    Free,
}

/// One lifecycle event of one request, from one replica (or a worker).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActiveSequenceEvent {
    /// The request (unique across replicas).
    pub request_id: RequestId,
    /// The worker it is booked on.
    pub worker: WorkerId,
    /// What happened.
    pub data: ActiveSequenceData,
    /// Who published it: a replica's id, or a worker's origin id for
    /// worker-origin marks.
    pub router_id: ReplicaId,
    /// The request's LoRA adapter, if any.
    pub lora_name: Option<String>,
}

impl ActiveSequenceEvent {
    /// The wire form of a write-model event. `worker` is the request's
    /// worker (only `Add` carries it in the write model).
    pub fn from_sequence_event(
        router_id: ReplicaId,
        worker: WorkerId,
        event: &SequenceEvent,
        lora_name: Option<String>,
    ) -> Self {
        let (request_id, worker, data) = match event {
            SequenceEvent::Add(add) => (
                add.request,
                add.worker,
                ActiveSequenceData::AddRequest {
                    prompt_tokens: add.prompt_tokens,
                    blocks: add.blocks.clone(),
                    overlap_blocks: add.overlap_blocks,
                    expected_prefill_ms: add.expected_prefill_ms,
                },
            ),
            SequenceEvent::MarkPrefillCompleted(id) => {
                (*id, worker, ActiveSequenceData::MarkPrefillCompleted)
            }
            SequenceEvent::Free(id) => (*id, worker, ActiveSequenceData::Free),
        };
        Self {
            request_id,
            worker,
            data,
            router_id,
            lora_name,
        }
    }

    /// A booking.
    pub fn add(router_id: ReplicaId, add: &AddRequest, lora_name: Option<String>) -> Self {
        Self::from_sequence_event(
            router_id,
            add.worker,
            &SequenceEvent::Add(add.clone()),
            lora_name,
        )
    }

    /// The write-model event to apply.
    pub fn to_sequence_event(&self) -> SequenceEvent {
        match &self.data {
            ActiveSequenceData::AddRequest {
                prompt_tokens,
                blocks,
                overlap_blocks,
                expected_prefill_ms,
            } => SequenceEvent::Add(AddRequest {
                request: self.request_id,
                worker: self.worker,
                prompt_tokens: *prompt_tokens,
                blocks: blocks.clone(),
                overlap_blocks: *overlap_blocks,
                expected_prefill_ms: *expected_prefill_ms,
            }),
            ActiveSequenceData::MarkPrefillCompleted => {
                SequenceEvent::MarkPrefillCompleted(self.request_id)
            }
            ActiveSequenceData::Free => SequenceEvent::Free(self.request_id),
        }
    }
}

/// A session's turn landed on a worker: peers pin the session there too, so
/// its next turn goes to the worker holding its KV prefix whichever replica
/// receives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionBinding {
    /// The session (a hash of the client's id, never the id itself).
    pub session: SessionKey,
    /// Where its last turn was dispatched.
    pub worker: WorkerId,
    /// Context tokens of that turn's prompt.
    pub context_tokens: u64,
}

/// One part of a replica's digest of its live bookings: the sender's live
/// bookings with request ids in `lo..=hi` are exactly `live`. A digest is
/// split into parts whose ranges cover every request id, so each part can
/// be applied on its own and a lost part only delays its range.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DigestPart {
    /// First request id covered.
    pub lo: RequestId,
    /// Last request id covered.
    pub hi: RequestId,
    /// The sender's live bookings in `lo..=hi`, ascending.
    pub live: Vec<RequestId>,
}

impl DigestPart {
    /// Splits a set of live request ids (any order) into parts of at most
    /// `max_ids` ids each, whose ranges cover `0..=u128::MAX` without gaps
    /// or overlaps. No ids: one empty part covering everything.
    pub fn split(mut live: Vec<RequestId>, max_ids: usize) -> Vec<DigestPart> {
        live.sort_unstable();
        live.dedup();
        let max_ids = max_ids.max(1);
        let chunks: Vec<&[RequestId]> = live.chunks(max_ids).collect();
        if chunks.is_empty() {
            return vec![DigestPart {
                lo: RequestId(0),
                hi: RequestId(u128::MAX),
                live: Vec::new(),
            }];
        }
        let mut parts = Vec::with_capacity(chunks.len());
        for (i, chunk) in chunks.iter().enumerate() {
            let lo = if i == 0 { RequestId(0) } else { chunk[0] };
            let hi = match chunks.get(i + 1) {
                // The next part starts at its first id; ids are distinct,
                // so that id is at least one more than this chunk's last.
                Some(next) => RequestId(next[0].0 - 1),
                None => RequestId(u128::MAX),
            };
            parts.push(DigestPart {
                lo,
                hi,
                live: chunk.to_vec(),
            });
        }
        parts
    }
}

/// A stored response (`/v1/responses`) answered by a worker through this
/// replica: peers send a later `previous_response_id`, `GET` or cancel of
/// it to the same worker. An id, never content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The response's id (at most 128 bytes; longer ones are not kept).
    pub id: String,
    /// The worker that stores it.
    pub worker: WorkerId,
    /// Its chain's session, carried to the chain's next turn.
    pub session: Option<SessionKey>,
    /// The digest of the client key that created it (`None` when the
    /// router requires no keys): peers answer it to that key only. The
    /// last field, absent from what replicas before owners sent (read as
    /// `None`); a replica before owners counts a batch carrying it as
    /// malformed, so replicas of one fleet are upgraded together.
    #[serde(default)]
    pub owner: Option<u64>,
}

/// One message of the replica plane.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct ReplicaBatch {
    /// The sender; peers ignore batches carrying their own id.
    pub router_id: ReplicaId,
    /// Lifecycle events, in the order the sender applied them.
    pub events: Vec<ActiveSequenceEvent>,
    /// Session bindings made since the sender's previous batch.
    #[serde(default)]
    pub sessions: Vec<SessionBinding>,
    /// One part of the sender's digest of its live bookings, in a message
    /// of its own (no events, no sessions). Left out of the encoding when
    /// absent, so replicas older than digests still decode every other
    /// message.
    #[serde(default)]
    pub digest: Option<DigestPart>,
    /// Stored responses answered since the sender's previous batch. The
    /// last field, written only when there are some (then `digest` is
    /// written too, as nil when absent, to keep the positions); a replica
    /// older than this field fails to decode such a message and counts it
    /// as malformed, and decodes every other.
    #[serde(default)]
    pub responses: Vec<StoredResponse>,
}

impl Serialize for ReplicaBatch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let responses = !self.responses.is_empty();
        let digest = self.digest.is_some() || responses;
        let fields = 3 + usize::from(digest) + usize::from(responses);
        let mut st = s.serialize_struct("ReplicaBatch", fields)?;
        st.serialize_field("router_id", &self.router_id)?;
        st.serialize_field("events", &self.events)?;
        st.serialize_field("sessions", &self.sessions)?;
        if digest {
            st.serialize_field("digest", &self.digest)?;
        } else {
            st.skip_field("digest")?;
        }
        if responses {
            st.serialize_field("responses", &self.responses)?;
        } else {
            st.skip_field("responses")?;
        }
        st.end()
    }
}

impl ReplicaBatch {
    /// An empty batch: a heartbeat.
    pub fn heartbeat(router_id: ReplicaId) -> Self {
        Self {
            router_id,
            events: Vec::new(),
            sessions: Vec::new(),
            digest: None,
            responses: Vec::new(),
        }
    }

    /// Whether the batch carries nothing but its sender's liveness.
    pub fn is_heartbeat(&self) -> bool {
        self.events.is_empty()
            && self.sessions.is_empty()
            && self.digest.is_none()
            && self.responses.is_empty()
    }
}

/// A replica message could not be decoded.
#[derive(Debug, thiserror::Error)]
#[error("malformed replica batch ({len} bytes): {reason}")]
pub struct ReplicaDecodeError {
    /// Payload length.
    pub len: usize,
    /// The decoder's complaint.
    pub reason: String,
}

/// Encodes a batch, appending to `out` (reuse the buffer across batches).
pub fn encode_batch_into(batch: &ReplicaBatch, out: &mut Vec<u8>) {
    batch
        .serialize(&mut rmp_serde::Serializer::new(out))
        .expect("a replica batch always serializes into a Vec");
}

/// Encodes a batch.
pub fn encode_batch(batch: &ReplicaBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 48 * batch.events.len());
    encode_batch_into(batch, &mut out);
    out
}

/// Decodes one message. Never panics; bad input is an error.
pub fn decode_batch(bytes: &[u8]) -> Result<ReplicaBatch, ReplicaDecodeError> {
    rmp_serde::from_slice(bytes).map_err(|e| ReplicaDecodeError {
        len: bytes.len(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data() -> impl Strategy<Value = ActiveSequenceData> {
        prop_oneof![
            (
                any::<u32>(),
                proptest::collection::vec(any::<u64>().prop_map(LocalHash), 0..20),
                any::<u32>(),
                proptest::option::of(0.0..1e6f64),
            )
                .prop_map(
                    |(prompt_tokens, blocks, overlap_blocks, expected_prefill_ms)| {
                        ActiveSequenceData::AddRequest {
                            prompt_tokens,
                            blocks,
                            overlap_blocks,
                            expected_prefill_ms,
                        }
                    }
                ),
            Just(ActiveSequenceData::MarkPrefillCompleted),
            Just(ActiveSequenceData::Free),
        ]
    }

    fn event() -> impl Strategy<Value = ActiveSequenceEvent> {
        (
            any::<u128>(),
            any::<u64>(),
            any::<u32>(),
            data(),
            any::<u64>(),
            proptest::option::of("[a-z0-9-]{0,12}"),
        )
            .prop_map(
                |(id, worker, rank, data, router, lora_name)| ActiveSequenceEvent {
                    request_id: RequestId(id),
                    worker: WorkerId::with_rank(worker, rank),
                    data,
                    router_id: ReplicaId(router),
                    lora_name,
                },
            )
    }

    fn batch() -> impl Strategy<Value = ReplicaBatch> {
        (
            any::<u64>(),
            proptest::collection::vec(event(), 0..10),
            proptest::collection::vec(
                (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(s, w, c)| SessionBinding {
                    session: SessionKey(s),
                    worker: WorkerId::new(w),
                    context_tokens: c,
                }),
                0..3,
            ),
        )
            .prop_map(|(router, events, sessions)| ReplicaBatch {
                router_id: ReplicaId(router),
                events,
                sessions,
                digest: None,
                responses: Vec::new(),
            })
    }

    proptest! {
        #[test]
        fn every_batch_survives_an_encode_decode_round_trip(b in batch()) {
            prop_assert_eq!(decode_batch(&encode_batch(&b)).unwrap(), b);
        }

        #[test]
        fn arbitrary_bytes_decode_to_an_error_or_a_batch_without_panicking(
            bytes in proptest::collection::vec(any::<u8>(), 0..256)
        ) {
            let _ = decode_batch(&bytes);
        }

        #[test]
        fn a_truncated_batch_is_an_error_not_a_panic(b in batch(), cut in 0usize..64) {
            let bytes = encode_batch(&b);
            let cut = cut.min(bytes.len().saturating_sub(1));
            prop_assert!(decode_batch(&bytes[..cut]).is_err());
        }

        #[test]
        fn write_model_events_convert_to_the_wire_and_back(e in event()) {
            let back = ActiveSequenceEvent::from_sequence_event(
                e.router_id, e.worker, &e.to_sequence_event(), e.lora_name.clone());
            prop_assert_eq!(back, e);
        }
    }

    proptest! {
        #[test]
        fn digest_parts_cover_every_id_once_and_list_each_live_id_in_its_range(
            ids in proptest::collection::vec(any::<u128>(), 0..200),
            max_ids in 1usize..50,
        ) {
            let live: Vec<RequestId> = ids.iter().copied().map(RequestId).collect();
            let parts = DigestPart::split(live.clone(), max_ids);
            prop_assert_eq!(parts[0].lo, RequestId(0));
            prop_assert_eq!(parts.last().unwrap().hi, RequestId(u128::MAX));
            for pair in parts.windows(2) {
                prop_assert_eq!(pair[0].hi.0.checked_add(1), Some(pair[1].lo.0));
            }
            for part in &parts {
                prop_assert!(part.live.len() <= max_ids);
                prop_assert!(part.lo <= part.hi);
                prop_assert!(part.live.iter().all(|id| (part.lo..=part.hi).contains(id)));
            }
            for id in &live {
                let holders = parts.iter().filter(|p| p.live.contains(id)).count();
                prop_assert_eq!(holders, 1);
            }
        }
    }

    #[test]
    fn a_batch_with_a_digest_round_trips_and_a_batch_without_one_decodes() {
        let mut batch = ReplicaBatch::heartbeat(ReplicaId(3));
        batch.digest = DigestPart::split(vec![RequestId(9), RequestId(2)], 8).pop();
        assert!(!batch.is_heartbeat());
        assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
        // `[router_id, events, sessions]`, the shape before digests.
        let bytes = rmp_serde::to_vec(&(
            ReplicaId(5),
            Vec::<ActiveSequenceEvent>::new(),
            Vec::<SessionBinding>::new(),
        ))
        .unwrap();
        assert_eq!(decode_batch(&bytes).unwrap().digest, None);
    }

    #[test]
    fn a_replica_older_than_digests_decodes_batches_without_one() {
        // The shape an older replica decodes into.
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct Before {
            router_id: ReplicaId,
            events: Vec<ActiveSequenceEvent>,
            #[serde(default)]
            sessions: Vec<SessionBinding>,
        }
        let plain = ReplicaBatch {
            sessions: vec![SessionBinding {
                session: SessionKey(1),
                worker: WorkerId::new(2),
                context_tokens: 3,
            }],
            ..ReplicaBatch::heartbeat(ReplicaId(4))
        };
        let old: Before = rmp_serde::from_slice(&encode_batch(&plain)).unwrap();
        assert_eq!((old.router_id, old.sessions.len()), (ReplicaId(4), 1));
        // A digest message is one it cannot read: it counts it as
        // malformed and skips it (documented).
        let mut with_digest = plain.clone();
        with_digest.digest = DigestPart::split(vec![RequestId(1)], 4).pop();
        assert!(rmp_serde::from_slice::<Before>(&encode_batch(&with_digest)).is_err());
    }

    #[test]
    fn stored_responses_round_trip_with_or_without_a_digest_and_keep_older_shapes_decoding() {
        let stored = StoredResponse {
            id: "resp_1".into(),
            worker: WorkerId::new(7),
            session: Some(SessionKey(9)),
            owner: Some(11),
        };
        let mut batch = ReplicaBatch::heartbeat(ReplicaId(3));
        batch.responses.push(stored.clone());
        assert!(!batch.is_heartbeat());
        assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
        batch.digest = DigestPart::split(vec![RequestId(4)], 8).pop();
        assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
        // Without responses the encoding is what it was before them.
        let plain = ReplicaBatch::heartbeat(ReplicaId(3));
        let before = rmp_serde::to_vec(&(
            ReplicaId(3),
            Vec::<ActiveSequenceEvent>::new(),
            Vec::<SessionBinding>::new(),
        ))
        .unwrap();
        assert_eq!(encode_batch(&plain), before);
    }

    #[test]
    fn a_batch_written_before_sessions_existed_still_decodes() {
        // `[router_id, events]`, the two-field shape.
        let bytes = rmp_serde::to_vec(&(ReplicaId(5), Vec::<ActiveSequenceEvent>::new())).unwrap();
        let batch = decode_batch(&bytes).unwrap();
        assert!(batch.is_heartbeat());
        assert_eq!(batch.router_id, ReplicaId(5));
    }

    #[test]
    fn a_booking_of_sixteen_full_width_blocks_encodes_in_under_240_bytes() {
        let add = AddRequest {
            request: RequestId(u128::MAX),
            worker: WorkerId::new(3),
            prompt_tokens: 256,
            blocks: (0..16).map(|i| LocalHash(u64::MAX - i)).collect(),
            overlap_blocks: 4,
            expected_prefill_ms: Some(12.5),
        };
        let batch = ReplicaBatch {
            router_id: ReplicaId(u64::MAX),
            events: vec![ActiveSequenceEvent::add(ReplicaId(u64::MAX), &add, None)],
            sessions: Vec::new(),
            digest: None,
            responses: Vec::new(),
        };
        let len = encode_batch(&batch).len();
        // 16 × 9 bytes of hashes dominate; the envelope is about 80 bytes.
        assert!(len < 240, "{len} bytes");
    }
}
