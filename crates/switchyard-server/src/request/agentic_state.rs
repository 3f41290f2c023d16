//! The agentic APIs' state in the router ([`AgenticState`], held by
//! [`AppState`](crate::request::context::AppState)): which API a request
//! came through, where stored responses live, and the requests counted by
//! API. Apart from [`agentic`](crate::request::agentic) so that the state
//! every handler shares does not depend on the handlers' code.

use crate::metrics::RequestStatus;
use crate::response_map::ResponseMap;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use std::sync::Arc;
pub(crate) use switchyard_wire::agentic::AgenticApi;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApiLabels {
    api: &'static str,
    status: &'static str,
}

/// The agentic APIs' router state: where stored responses live, and the
/// requests counted by API.
#[derive(Debug)]
pub(crate) struct AgenticState {
    /// Response id → the worker that stores it.
    pub(crate) responses: Arc<ResponseMap>,
    requests: Family<ApiLabels, Counter>,
}

impl AgenticState {
    pub(crate) fn new(responses: ResponseMap) -> Self {
        let requests = Family::<ApiLabels, Counter>::default();
        for api in [AgenticApi::Responses, AgenticApi::Messages] {
            for status in RequestStatus::ALL {
                drop(requests.get_or_create(&ApiLabels {
                    api: api.label(),
                    status: status.label(),
                }));
            }
        }
        Self {
            responses: Arc::new(responses),
            requests,
        }
    }

    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_api_requests",
            "Requests of the Responses and Messages APIs by API and how they ended (also counted in switchyard_requests_total)",
            self.requests.clone(),
        );
        self.responses.register(registry);
    }

    /// Counts a request of `api` that ended with `status` (besides
    /// `switchyard_requests_total`, counted by the shared path).
    pub(crate) fn count(&self, api: AgenticApi, status: RequestStatus) {
        self.requests
            .get_or_create(&ApiLabels {
                api: api.label(),
                status: status.label(),
            })
            .inc();
    }

    /// Requests of `api` counted with `status`.
    #[cfg(test)]
    pub(crate) fn counted(&self, api: AgenticApi, status: RequestStatus) -> u64 {
        self.requests
            .get_or_create(&ApiLabels {
                api: api.label(),
                status: status.label(),
            })
            .get()
    }
}
