//! Access control and hostile input: wrong secret or job in both directions, malformed and
//! oversized frames, garbage, half-open connections, the connection limit.
mod common;

use clairvoyant_net::frame::{Header, Kind, HEADER_LEN};
use clairvoyant_net::{Client, Fetch, Secret, Server, ServerStats};
use common::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Wait (bounded) until the server's stats satisfy `f`.
fn stats_until(s: &Server, f: impl Fn(&ServerStats) -> bool) -> ServerStats {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = s.stats();
        if f(&st) || Instant::now() > deadline {
            return st;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn works(server: &Server) {
    let client = Client::new(client_cfg(7), vec![server.local_addr()]);
    let mut dst = vec![0u8; 4096];
    assert_eq!(
        client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(),
        Fetch::Got,
        "a good client is still served"
    );
    assert_eq!(dst, sample_bytes(1, 4096));
}

#[test]
fn client_with_wrong_secret_or_job_is_refused() {
    let server = start(MemProvider::with_sizes(&[(1, 4096)]));
    let mut cfg = client_cfg(7);
    cfg.secret = Secret::from_bytes(b"some other job's secret").unwrap();
    let wrong_secret = Client::new(cfg, vec![server.local_addr()]);
    let mut dst = vec![0u8; 4096];
    assert_eq!(
        wrong_secret.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(),
        Fetch::PeerDown
    );
    assert!(wrong_secret.is_down(0));
    let wrong_job = Client::new(client_cfg(8), vec![server.local_addr()]);
    assert_eq!(
        wrong_job.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(),
        Fetch::PeerDown
    );
    // A wrong secret is caught by the client (the server's MAC does not verify) before it
    // proves anything; make the server judge one too, with a raw client sending a bad MAC.
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    s.write_all(&Header::new(Kind::Hello, 0, 32, 7).encode()).unwrap();
    s.write_all(&[5u8; 32]).unwrap();
    let mut challenge = [0u8; HEADER_LEN + 64];
    s.read_exact(&mut challenge).unwrap();
    s.write_all(&Header::new(Kind::Auth, 0, 32, 0).encode()).unwrap();
    s.write_all(&[9u8; 32]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).unwrap(), 0, "the server closes after a bad MAC");
    let st = stats_until(&server, |st| st.auth_failures >= 2);
    assert_eq!(st.auth_failures, 2, "wrong job and bad MAC: {st:?}");
    assert_eq!(st.served, 0);
    works(&server);
}

#[test]
fn server_with_wrong_secret_is_refused_by_the_client() {
    // A fake server that answers every Hello with a challenge it cannot have computed.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hello = [0u8; HEADER_LEN + 32];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&Header::new(Kind::Challenge, 0, 64, 0).encode()).unwrap();
        s.write_all(&[3u8; 64]).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    });
    let client = Client::new(client_cfg(7), vec![addr]);
    let mut dst = vec![0u8; 16];
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    assert!(
        fake.join().unwrap().is_empty(),
        "the client sent nothing after an unverified challenge"
    );
    assert_eq!(client.stats().down_events, vec![1]);
}

#[test]
fn malformed_oversized_garbage_and_half_open_do_not_hurt_the_server() {
    let server = start(MemProvider::with_sizes(&[(1, 4096)]));
    let addr = server.local_addr();
    let send = |bytes: &[u8]| {
        let mut s = TcpStream::connect(addr).unwrap();
        let _ = s.write_all(bytes);
        s
    };
    // Oversized Hello (a 4 GiB payload announced), garbage, wrong version, a Get before auth.
    let mut oversized = Header::new(Kind::Hello, 0, 32, 7).encode();
    oversized[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut version = Header::new(Kind::Hello, 0, 32, 7).encode();
    version[4] = 99;
    let held = [
        send(&oversized),
        send(&[0xFFu8; 100]),
        send(&version),
        send(&Header::new(Kind::Get, 1, 0, 0).encode()),
        send(&[]),              // connects, sends nothing
        send(&oversized[..10]), // half a header, then silence
    ];
    let t0 = Instant::now();
    let st = stats_until(&server, |st| st.rejected_connections >= 6 && st.open_connections == 0);
    assert!(st.rejected_frames >= 4, "{st:?}");
    assert_eq!(st.rejected_connections, 6, "{st:?}");
    assert_eq!(
        st.open_connections, 0,
        "silent connections are closed after io_timeout: {st:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "closed within io_timeout (500 ms), took {:?}",
        t0.elapsed()
    );
    drop(held);
    works(&server);
    // After authentication a bad frame still only closes that connection.
    let client = Client::new(client_cfg(7), vec![addr]);
    let mut dst = vec![0u8; 4096];
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    server.shutdown();
}

#[test]
fn connections_over_the_limit_take_the_slot_of_the_oldest_handshake() {
    let mut cfg = server_cfg(7);
    cfg.max_connections = 2;
    cfg.io_timeout = Duration::from_secs(5);
    let server = Server::start(cfg, Arc::new(MemProvider::with_sizes(&[(1, 10)]))).unwrap();
    let mut a = TcpStream::connect(server.local_addr()).unwrap();
    stats_until(&server, |st| st.open_connections == 1);
    let b = TcpStream::connect(server.local_addr()).unwrap();
    stats_until(&server, |st| st.open_connections == 2);
    // Full of connections that have not authenticated: the third takes the slot of the one
    // that has been handshaking longest, which is closed and counted.
    let c = TcpStream::connect(server.local_addr()).unwrap();
    let st = stats_until(&server, |st| st.rejected_connections >= 1);
    assert!(st.open_connections <= 2, "{st:?}");
    a.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut buf = [0u8; 1];
    let got = a.read(&mut buf);
    assert!(
        matches!(&got, Ok(0)) || matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "the oldest handshaking connection is closed: {got:?}"
    );
    drop((b, c));
    stats_until(&server, |st| st.open_connections == 0);
    let client = Client::new(client_cfg(7), vec![server.local_addr()]);
    let mut dst = vec![0u8; 10];
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
}

#[test]
fn silent_trickling_and_slow_reading_connections_do_not_starve_others() {
    let mut cfg = server_cfg(7);
    cfg.max_connections = 512;
    cfg.io_timeout = Duration::from_secs(5);
    (cfg.workers, cfg.waiters) = (2, 2);
    let big = 8 << 20;
    let server = Server::start(cfg, Arc::new(MemProvider::with_sizes(&[(1, 4096), (2, big)]))).unwrap();
    let addr = server.local_addr();
    // 200 unauthenticated connections: silent, or half a Hello and then silence.
    let hello = Header::new(Kind::Hello, 0, 32, 7).encode();
    let silent: Vec<TcpStream> = (0..200)
        .map(|i| {
            let mut s = TcpStream::connect(addr).unwrap();
            if i % 2 == 0 {
                s.write_all(&hello[..10]).unwrap();
            }
            s
        })
        .collect();
    // More authenticated peers than workers ask for 8 MiB each and never read the reply.
    let slow: Vec<TcpStream> = (0..6)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            assert!(clairvoyant_net::fuzzing::authenticate(&mut s, &secret(), 7));
            s.write_all(&Header::new(Kind::Get, 2, 0, 0).encode()).unwrap();
            s
        })
        .collect();
    stats_until(&server, |st| st.served >= 6);
    let client = Client::new(client_cfg(7), vec![addr]);
    let mut dst = vec![0u8; 4096];
    let t0 = Instant::now();
    for _ in 0..20 {
        assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    }
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "20 fetches next to 200 silent and 6 stalled readers took {took:?}"
    );
    let st = server.stats();
    assert_eq!(st.open_connections, 200 + 6 + 1, "{st:?}");
    eprintln!("20 fetches beside 200 silent connections and 6 stalled readers: {took:?}");
    drop((silent, slow));
}
