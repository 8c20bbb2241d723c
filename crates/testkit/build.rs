//! `sqlx::migrate!` embeds every folder of `migrations/`; a new migration file must trigger a
//! rebuild.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
