//! What the payoutdev test binaries share: the ports of a stack of their own.

use testkit::free_port;

/// The first port of `len` consecutive free ports, reserved for the caller: the tests of this
/// binary run at once, each with a stack of its own, and their blocks must not overlap.
fn free_port_block(len: u16) -> u16 {
    static TAKEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut taken = TAKEN.lock().unwrap();
    loop {
        let base = free_port();
        if base.checked_add(len).is_some()
            && (0..len).all(|i| !taken.contains(&(base + i)))
            && (0..len).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok())
        {
            taken.extend((0..len).map(|i| base + i));
            testkit::util::reserve_ports((0..len).map(|i| base + i));
            return base;
        }
    }
}

/// One block of free ports as `stack up`'s variables, laid out so that the ports each part
/// derives from its own (etcd's peer port = client + 1; Temporal's HTTP and metrics = UI + 1,
/// + 2; our services = base + 1..31) never land on another part's.
pub fn stack_ports() -> [(&'static str, u16); 6] {
    let b = free_port_block(60);
    [
        ("PAYOUT_PG_MAIN_PORT", b),
        ("PAYOUT_PG_PROXY_PORT", b + 1),
        ("PAYOUT_ETCD_PORT", b + 2),
        ("PAYOUT_TEMPORAL_PORT", b + 5),
        ("PAYOUT_TEMPORAL_UI_PORT", b + 6),
        ("PAYOUT_SERVICE_PORT_BASE", b + 10),
    ]
}
