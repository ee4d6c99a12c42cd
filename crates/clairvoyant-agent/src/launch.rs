//! What a launcher (`clairvoyant run`) asks of the system for the program it starts.

/// Have this process killed (`SIGKILL`) when the launcher `parent` dies without stopping it,
/// killed itself with `SIGKILL` for instance: a launcher and its program are one rank, and go
/// together as the program alone would. Called in the child between `fork` and `exec`; the
/// request survives the `exec` (`PR_SET_PDEATHSIG`). Where `parent` is gone already (it died
/// before the request was made), this process is killed now. `false` where the kernel refused.
pub fn die_with_launcher(parent: libc::pid_t) -> bool {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number and no pointers; getppid and
    // raise have no preconditions.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
            return false;
        }
        if libc::getppid() != parent {
            libc::raise(libc::SIGKILL);
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_dies_with_its_parent_and_not_before() {
        // A child that forks a grandchild asking to die with the child, then exits: the
        // grandchild, parked in pause(), is killed; while the child lives, it is not.
        let mut pipe = [0; 2];
        // SAFETY: a two-int array for pipe(2).
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child only calls async-signal-safe functions before _exit.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            // SAFETY: async-signal-safe calls only (fork, getpid, prctl, getppid, write, pause, _exit).
            unsafe {
                let me = libc::getpid();
                let grandchild = libc::fork();
                if grandchild == 0 {
                    let ok = die_with_launcher(me);
                    let alive = libc::getpid();
                    let msg = if ok { alive } else { -1 };
                    libc::write(pipe[1], &msg as *const i32 as *const libc::c_void, 4);
                    loop {
                        libc::pause();
                    }
                }
                // Wait until the grandchild has made its request, then leave.
                let mut buf = [0u8; 4];
                libc::read(pipe[0], buf.as_mut_ptr() as *mut libc::c_void, 4);
                libc::write(pipe[1], buf.as_ptr() as *const libc::c_void, 4);
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        let mut buf = [0u8; 4];
        // SAFETY: reading 4 bytes into a 4-byte buffer.
        let n = unsafe { libc::read(pipe[0], buf.as_mut_ptr() as *mut libc::c_void, 4) };
        assert_eq!(n, 4);
        let grandchild = i32::from_ne_bytes(buf);
        assert!(grandchild > 0, "the kernel refused PR_SET_PDEATHSIG");
        // The grandchild was re-parented and killed: gone, or a zombie until its new parent reaps it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while let Ok(stat) = std::fs::read_to_string(format!("/proc/{grandchild}/stat")) {
            let state = stat.rsplit_once(") ").map(|(_, rest)| rest.as_bytes()[0]);
            if matches!(state, Some(b'Z') | Some(b'X')) {
                break;
            }
            if std::time::Instant::now() >= deadline {
                // SAFETY: a signal to the process this test started.
                unsafe { libc::kill(grandchild, libc::SIGKILL) };
                panic!("the grandchild outlived its parent");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
