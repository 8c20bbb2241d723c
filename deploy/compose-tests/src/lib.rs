//! The compose deployment's helpers: [`probe`] (the health checks run inside the containers by
//! `payout-probe`) and [`compose`] (driving `docker compose` / `docker-compose` from the tests).

pub mod compose;
pub mod probe;
