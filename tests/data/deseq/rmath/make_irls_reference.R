# R 4.2.2 / DESeq2 1.38.3 (reference BLAS and LAPACK 3.11): R's IRLS (fitBeta), its starting coefficients and the
# derivative of the dispersion search on pasilla ~ type + condition, and R's trigamma, written as C99 hex floats
# for tests/deseq/test_rmath.py.
#   fitbeta_type_condition.csv  150 genes: counts, size factors, a random dispersion, R's start
#                 t(solve(qr.R, t(qr.Q) %*% log(normalised + 0.1))), fitBeta's coefficients (natural log) and
#                 iterations, and the means normalizationFactors * exp(X beta) that fitNbinomGLMs returns
#   dlp_type_condition.csv  genes after estimateDispersionsGeneEst (their means), at log alpha = log(dispGeneEst) +
#                 N(0, 0.5): fitDisp's initial log posterior and derivative (maxit = 0). The genes are the 19 of
#                 12,359 where R's derivative takes the C library's pow(x, -1) somewhere the compiler made a
#                 division (found by trying both on every gene), and 120 at random.
#   trigamma.csv  x, trigamma(x)
# Run in this folder: Rscript make_irls_reference.R /path/to/shared/data/bulk/pasilla
source("pasilla_setup.R")  # DESeq2, hx(), cts, md, design, mm, irls_fit(), irls_table()

set.seed(11)
keep <- sort(sample(which(rowSums(cts) > 0), 150))
dds <- estimateSizeFactors(DESeqDataSetFromMatrix(cts, md, design))[keep, ]
n <- ncol(dds)
alpha <- exp(runif(nrow(dds), log(1e-4), log(5)))
ir <- irls_fit(dds, alpha)
mu <- ir$nf * t(exp(mm %*% t(ir$fit$beta_mat)))
out <- irls_table(dds, alpha, ir)
for (j in seq_len(n)) out[[paste0("mu", j)]] <- hx(mu[, j])
write.csv(out, "fitbeta_type_condition.csv", row.names = FALSE, quote = FALSE)

dds <- estimateSizeFactors(DESeqDataSetFromMatrix(cts, md, design))
dds <- suppressMessages(estimateDispersionsGeneEst(dds))
nz <- which(!mcols(dds)$allZero)
set.seed(3)
la <- log(mcols(dds)$dispGeneEst[nz]) + rnorm(length(nz), 0, 0.5)
pick <- c("FBgn0000084","FBgn0000182","FBgn0000307","FBgn0000633","FBgn0001197","FBgn0001330","FBgn0002021","FBgn0002542","FBgn0002719","FBgn0003118","FBgn0003448","FBgn0003676","FBgn0004057","FBgn0004893","FBgn0005322","FBgn0005777","FBgn0010014","FBgn0010288","FBgn0010434","FBgn0013955","FBgn0015391","FBgn0016687","FBgn0021767","FBgn0023388","FBgn0025382","FBgn0025455","FBgn0028897","FBgn0028991","FBgn0029526","FBgn0029688","FBgn0029976","FBgn0030010","FBgn0030173","FBgn0030258","FBgn0030410","FBgn0030826","FBgn0030966","FBgn0031040","FBgn0031184","FBgn0031284","FBgn0031422","FBgn0031597","FBgn0031617","FBgn0031987","FBgn0032338","FBgn0032398","FBgn0032415","FBgn0032486","FBgn0032636","FBgn0032702","FBgn0032707","FBgn0032884","FBgn0032894","FBgn0033315","FBgn0033348","FBgn0033912","FBgn0034070","FBgn0034477","FBgn0034489","FBgn0034612","FBgn0034735","FBgn0034748","FBgn0034935","FBgn0035001","FBgn0035073","FBgn0035381","FBgn0035399","FBgn0035513","FBgn0035689","FBgn0035714","FBgn0035938","FBgn0036024","FBgn0036336","FBgn0036411","FBgn0036485","FBgn0036714","FBgn0036817","FBgn0036888","FBgn0036987","FBgn0037181","FBgn0037377","FBgn0037487","FBgn0037563","FBgn0037780","FBgn0037786","FBgn0037856","FBgn0037891","FBgn0038095","FBgn0038241","FBgn0038258","FBgn0038332","FBgn0038554","FBgn0038619","FBgn0038830","FBgn0038919","FBgn0039006","FBgn0039145","FBgn0039207","FBgn0039228","FBgn0039250","FBgn0039344","FBgn0039360","FBgn0040273","FBgn0040286","FBgn0040305","FBgn0040389","FBgn0040529","FBgn0040959","FBgn0042696","FBgn0043458","FBgn0044871","FBgn0046875","FBgn0050076","FBgn0050272","FBgn0050373","FBgn0051463","FBgn0051641","FBgn0051769","FBgn0051804","FBgn0051815","FBgn0052091","FBgn0052259","FBgn0052319","FBgn0052423","FBgn0052667","FBgn0052797","FBgn0053283","FBgn0053340","FBgn0053653","FBgn0053868","FBgn0063381","FBgn0066365","FBgn0085236","FBgn0085308","FBgn0086200","FBgn0259113","FBgn0259997","FBgn0261262","FBgn0261562")
sel <- match(pick, rownames(dds)[nz])
mu <- assay(dds, "mu")[nz[sel], ]; y <- counts(dds)[nz[sel], ]
r <- DESeq2:::fitDispWrapper(ySEXP = y, xSEXP = mm, mu_hatSEXP = mu, log_alphaSEXP = la[sel],
  log_alpha_prior_meanSEXP = la[sel], log_alpha_prior_sigmasqSEXP = 1, min_log_alphaSEXP = log(1e-9),
  kappa_0SEXP = 1, tolSEXP = 1e-6, maxitSEXP = 0, usePriorSEXP = FALSE, weightsSEXP = matrix(1, nrow(y), ncol(y)),
  useWeightsSEXP = FALSE, weightThresholdSEXP = 1e-2, useCRSEXP = TRUE)
out <- data.frame(gene = pick)
for (j in seq_len(n)) out[[paste0("y", j)]] <- y[, j]
for (j in seq_len(n)) out[[paste0("mu", j)]] <- hx(mu[, j])
out$la <- hx(la[sel]); out$lp <- hx(r$initial_lp); out$dlp <- hx(r$initial_dlp)
write.csv(out, "dlp_type_condition.csv", row.names = FALSE, quote = FALSE)

x <- c(0.3, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7, 9.5, 10, 12.5, 50, 1000, 1e6, runif(40, 0.05, 200))
write.csv(data.frame(x = hx(x), trigamma = hx(trigamma(x))), "trigamma.csv", row.names = FALSE, quote = FALSE)
