//! The HTTP limits in force: the configured ones, with the connection cap fitted to the
//! open-file limit.

use crate::config::{Config, HttpConfig};

/// The connection cap when none is configured and the open-file limit leaves room for it.
const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

/// The HTTP limits in force. The open-file limit is raised to its hard limit first; an unset
/// connection cap then keeps a quarter of the descriptors for models, plugins, indexes and
/// the ledger.
pub(super) fn limits(cfg: &Config) -> HttpConfig {
    let mut http = cfg.http.clone();
    let room = crate::server::raise_fd_limit().map(connection_room);
    http.max_connections = max_connections(http.max_connections, room);
    http
}

/// Connections `open_files` descriptors leave room for: a quarter of them (after 64) stay for
/// everything else.
fn connection_room(open_files: u64) -> usize {
    ((open_files as usize).saturating_sub(64) * 3 / 4).max(1)
}

/// The connection cap: the configured one, kept (with a warning) even above `room`; when unset
/// (0), the default within `room`.
fn max_connections(configured: usize, room: Option<usize>) -> usize {
    match (configured, room) {
        (0, Some(room)) => DEFAULT_MAX_CONNECTIONS.min(room),
        (0, None) => DEFAULT_MAX_CONNECTIONS,
        (n, Some(room)) if n > room => {
            tracing::warn!(
                max_connections = n,
                fits = room,
                "max_connections is above what the open-file limit leaves room for"
            );
            n
        }
        (n, _) => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quarter_of_the_descriptors_stays_free() {
        assert_eq!(connection_room(1024), 720);
        assert_eq!(connection_room(1 << 20), 786_384);
        assert_eq!(connection_room(10), 1);
    }

    #[test]
    fn an_unset_cap_fits_the_room_and_a_set_one_is_kept() {
        assert_eq!(max_connections(0, Some(720)), 720);
        assert_eq!(max_connections(0, Some(786_384)), DEFAULT_MAX_CONNECTIONS);
        assert_eq!(max_connections(0, None), DEFAULT_MAX_CONNECTIONS);
        assert_eq!(max_connections(50_000, Some(720)), 50_000);
        assert_eq!(max_connections(500, None), 500);
    }
}
