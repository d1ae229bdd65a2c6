//! The gRPC contract between `wrk` clients, the scheduler and workers (`proto/wrk.proto`).
//!
//! Generated with `tonic`/`prost`; this crate adds only small conveniences on the generated types.

#![allow(clippy::all, clippy::pedantic)]

/// Generated messages and services of package `wrk.v1`.
pub mod v1 {
    tonic::include_proto!("wrk.v1");
}

pub use v1::*;

/// Largest gRPC message either side accepts: job specs carry component bytes.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

impl std::fmt::Display for TaskId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}#{}",
            self.job_id, self.stage, self.index, self.attempt
        )
    }
}

impl std::fmt::Display for PartitionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}/{}",
            self.job_id, self.stage, self.task, self.output
        )
    }
}

/// Authentication: callers send `authorization: Bearer <token>` (a tenant's token for client
/// calls, the cluster's worker token for worker calls).
pub mod auth {
    use tonic::metadata::{Ascii, MetadataValue};
    use tonic::service::Interceptor;
    use tonic::service::interceptor::InterceptedService;
    use tonic::transport::Channel;
    use tonic::{Request, Status};

    /// A channel whose calls carry a bearer token.
    pub type AuthChannel = InterceptedService<Channel, BearerToken>;

    /// Adds the token, if any, to every call.
    #[derive(Clone, Default)]
    pub struct BearerToken(Option<MetadataValue<Ascii>>);

    /// A token that cannot travel in an HTTP header.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct InvalidToken;

    impl std::fmt::Display for InvalidToken {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a token must be printable ASCII without spaces")
        }
    }

    impl std::error::Error for InvalidToken {}

    impl BearerToken {
        pub fn new(token: Option<&str>) -> Result<Self, InvalidToken> {
            match token {
                None => Ok(BearerToken(None)),
                Some(t) if !t.is_empty() && t.bytes().all(|b| b.is_ascii_graphic()) => {
                    let value = format!("Bearer {t}").parse().map_err(|_| InvalidToken)?;
                    Ok(BearerToken(Some(value)))
                }
                Some(_) => Err(InvalidToken),
            }
        }
    }

    impl Interceptor for BearerToken {
        fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
            if let Some(value) = &self.0 {
                request
                    .metadata_mut()
                    .insert("authorization", value.clone());
            }
            Ok(request)
        }
    }

    /// The metadata key carrying a partition ticket on `Worker.FetchPartition`.
    pub const TICKET_METADATA: &str = "wrk-ticket";

    /// The ticket for partition `key`: HMAC-SHA256 under the cluster's worker token, in hex.
    pub fn partition_ticket(secret: &[u8], key: &crate::PartitionKey) -> String {
        use hmac::{KeyInit, Mac};
        // HMAC accepts keys of any length.
        let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(key.to_string().as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether `ticket` is the ticket of `key` (compared in constant time).
    pub fn ticket_is_valid(secret: &[u8], key: &crate::PartitionKey, ticket: &str) -> bool {
        use hmac::{KeyInit, Mac};
        let Ok(expected) = hex::decode(ticket) else {
            return false;
        };
        let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(key.to_string().as_bytes());
        mac.verify_slice(&expected).is_ok()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn tickets_bind_the_key_and_the_secret() {
            let key = crate::PartitionKey {
                job_id: "job-000001".into(),
                stage: 1,
                task: 2,
                output: 0,
            };
            let ticket = partition_ticket(b"secret", &key);
            assert!(ticket_is_valid(b"secret", &key, &ticket));
            assert!(!ticket_is_valid(b"other", &key, &ticket));
            let other = crate::PartitionKey {
                task: 3,
                ..key.clone()
            };
            assert!(!ticket_is_valid(b"secret", &other, &ticket));
            assert!(!ticket_is_valid(b"secret", &key, "not hex"));
        }

        #[test]
        fn tokens_must_fit_in_a_header() {
            assert!(BearerToken::new(Some("abc-123_XYZ")).is_ok());
            assert_eq!(
                BearerToken::new(Some("has space")).err(),
                Some(InvalidToken)
            );
            assert_eq!(BearerToken::new(Some("")).err(), Some(InvalidToken));
            let mut interceptor = BearerToken::new(Some("t0k3n")).unwrap();
            let request = interceptor.call(Request::new(())).unwrap();
            assert_eq!(
                request.metadata().get("authorization").unwrap(),
                "Bearer t0k3n"
            );
        }
    }
}
