//! `sqlx::migrate!` embeds `migrations/gldb/`; a new migration file must trigger a rebuild.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations/gldb");
}
