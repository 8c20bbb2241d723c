//! `sqlx::migrate!` embeds `migrations/lockdb/`; a new migration file must trigger a rebuild.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations/lockdb");
}
