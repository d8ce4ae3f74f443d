from parrot.engine.kernels import main

raise SystemExit(main())
