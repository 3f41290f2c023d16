//! The simulator's integration tests, in one test binary (`it`).

mod single_router_golden;
