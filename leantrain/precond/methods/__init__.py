"""The preconditioning methods, one module each, on the base in
:mod:`leantrain.precond.preconditioned`: K-FAC, EKFAC, Shampoo, SOAP, PSGD, K-BFGS,
SENG, SMW-NG, the hook-based natural gradient, Newton, Hessian-free and the diagonal
empirical Fisher. Import them from :mod:`leantrain.precond`."""
