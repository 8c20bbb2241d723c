//! `sqlx::migrate!` embeds `migrations/paydb/`; a new migration file must trigger a rebuild.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations/paydb");
}
