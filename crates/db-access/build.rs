//! The `migrations` feature embeds every folder of `migrations/` with `sqlx::migrate!`; a new
//! migration file must trigger a rebuild.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
