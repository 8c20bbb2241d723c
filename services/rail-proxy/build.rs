//! `sqlx::migrate!` embeds `migrations/proxydb/`; a new migration file must trigger a rebuild.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations/proxydb");
}
