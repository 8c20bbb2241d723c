//! The gRPC contracts between our processes. One module per `.proto` file under `proto/`.
//! These are the wire types of a process boundary: each service converts them to its domain types
//! in one place (its `api` module) and nowhere else.

/// Lock service: sessions, grants with fencing tokens, force-revoke.
pub mod lock {
    tonic::include_proto!("lock.v1");
}

/// Payment resource: the account fence (first guard), payouts, the ledger, the outbox.
pub mod payment {
    tonic::include_proto!("payment.v1");
}

/// Rail proxy: the second guard, in front of the rail.
pub mod railproxy {
    tonic::include_proto!("railproxy.v1");
}

/// General Ledger: append-only double-entry journal.
pub mod ledger {
    tonic::include_proto!("ledger.v1");
}

/// Typed rejection details in a gRPC status: the encoded bytes of a service's `Rejection`
/// message travel in `Status::details`, so a client can match on a name instead of parsing text.
/// Servers write them with [`rejection::status`]; every contract crate reads them with
/// [`rejection::decode`] (one definition of the encoding, beside the messages it carries).
pub mod rejection {
    use prost::Message;

    pub fn status<M: Message>(
        code: tonic::Code,
        message: impl Into<String>,
        detail: &M,
    ) -> tonic::Status {
        tonic::Status::with_details(code, message, detail.encode_to_vec().into())
    }

    /// Decodes the details of a status; `None` if there are none or they are not an `M`.
    pub fn decode<M: Message + Default>(status: &tonic::Status) -> Option<M> {
        if status.details().is_empty() {
            return None;
        }
        M::decode(status.details()).ok()
    }
}
