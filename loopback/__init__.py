"""Real servers on 127.0.0.1 for the tests and the benchmarks, all thrown away afterwards; development only
(never copied into an image: the Dockerfile takes common, wheelbuilder, images and dflash).

    sshd.start(workdir, env, config)
                                    OpenSSH's sshd on a free port with throwaway host and user keys, SFTP;
                                    `env` becomes SetEnv lines of every login, `config` more sshd_config
                                    lines (AllowUsers, ForceCommand: a server that misbehaves)
    registry.start(workdir)         Debian's docker-registry with TLS (a CA made here) and htpasswd (bcrypt)
    engine.start(root, namespace)   a second, empty dockerd (no bridge, its own data root and containerd
                                    namespace) on ROOT/docker.sock: "the GPU box" an image travels to
    demo_image.demo_image(), demo_image.labelled_demo_image(tag)
                                    a small image with dflash-train's shape, and that image with the
                                    runtime image's labels, an SBOM and an entrypoint that answers `doctor`
    net.free_port()                 a free TCP port on 127.0.0.1

sshd.available() and registry.available() say why a server cannot run here (None when it can). The tests
(tests/support adds the pytest side: skips, the Proxmox doubles) and the benchmarks (bench_push.py,
bench_publish.py) import this package; neither imports the other. Needs root for sshd and dockerd, Debian's
docker-registry for the registry, and the cryptography and bcrypt packages (the dev lock) for its
certificate and password.
"""
