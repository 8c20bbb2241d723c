//! The migrations are embedded by `sqlx::migrate!`; a new file must trigger a rebuild.
fn main() {
    for db in ["paydb", "proxydb", "gldb", "lockdb"] {
        println!("cargo:rerun-if-changed=../migrations/{db}");
    }
}
